#!/usr/bin/python3
"""The multi-worker example server (examples/python/node_server/) with its
weights from `modelcache serve`, against the same server with per-worker
in-process caches, at 1, 2 and 4 uvicorn workers. The modes (--modes):

  daemon     the example as it is: each request acquires and releases; the
             client's delegation makes a warm acquire local (no round trip)
             and keeps the idle lease evictable by the daemon
  keep0      the same with MODELCACHE_KEEP_IDLE=0: no idle delegation, so a
             request whose model no other request of its worker uses is a
             round trip (the honest budget without delegation)
  kept10     the example as it was before delegation (git --kept-rev, by
             default 0662b25) with KEEP_LEASE_SECONDS=10: each worker keeps
             its leases, in use, for 10 s after their last request (fast,
             but the daemon cannot evict what a worker keeps "just in case")
  inprocess  WEIGHTS=inprocess: each worker reads the files into its own
             memory (modelcache.weights.HostWeightStore), as servers do
             without the daemon

For each configuration and run: the server is started (and, for the daemon,
`modelcache serve`), warmed until every worker has answered for every model,
then CLIENTS threads send REQUESTS requests over the five models (a warm
set), over the server's UNIX socket, each thread on its own keep-alive
connection. Reported: requests per second, p50 and p99 latency, and host RAM
after the run: the anonymous PSS of every server process (the workers and
uvicorn; private model copies are anonymous memory) plus, for the daemon,
its shared copies (the budget's used bytes; memfd pages counted once).

Then a fresh worker's time to its first answer on a resident model: a
one-worker server started against a daemon that already holds the model
(or, in-process, a page cache that holds the file): the first request's
X-Wait-Ms (getting the weights) and its whole latency.

Each figure is the median of --reps runs, taken rep by rep with every mode
in turn (the min-max of the runs beside it). CPU/req is the CPU time of the
server's processes and the daemon during the load, per request (the
daemon's share in parentheses): on a machine the load saturates, it is what
bounds the throughput. Every process is stopped by pid.

--builds compares builds side by side (two revisions' `modelcache` and
Python package, each in its own build folder): each rep runs every build in
turn, the order reversed every other rep, each with every mode; a row is
then "mode@folder", and the per-rep ratios of each build to the first are
printed. The first answer is skipped.

    PYTHONPATH=build/python /usr/bin/python3 bench/python/node_server.py
    # the issue's comparison, 4 workers:
    PYTHONPATH=build/python /usr/bin/python3 bench/python/node_server.py \
        --workers 4 --modes daemon,keep0,kept10,inprocess
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python/tests"))
sys.path.insert(0, str(ROOT / "examples/python/node_server"))

import models  # noqa: E402
import torch  # noqa: E402
from serve_util import Daemon, build_dir, wait_until  # noqa: E402
from serve_util import UnixHTTPConnection  # noqa: E402
from test_node_server import Server, children  # noqa: E402

import test_node_server  # noqa: E402


def pss_anon(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss_Anon:"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def cpu_seconds(pids: List[int]) -> float:
    """User + system CPU time of the processes (and their threads) so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def load(uds: str, clients: int, requests: int) -> Tuple[float, List[float], int]:
    """(seconds, per-request latencies in ms, errors)."""
    ids = list(models.SHAPES)
    bodies = {m: json.dumps({"inputs": torch.randn(2, models.SHAPES[m][0]).tolist()}).encode()
              for m in ids}
    per_client = requests // clients

    def one(c: int):
        conn = UnixHTTPConnection(uds)
        lat, errors = [], 0
        for i in range(per_client):
            m = ids[(c + i) % len(ids)]
            t = time.perf_counter()
            conn.request("POST", f"/v1/models/{m}/infer", body=bodies[m],
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            lat.append((time.perf_counter() - t) * 1000)
            errors += r.status != 200
        conn.close()
        return lat, errors

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        out = list(pool.map(one, range(clients)))
    seconds = time.perf_counter() - start
    return seconds, [x for l, _ in out for x in l], sum(e for _, e in out)


def warm(server: Server, workers: int) -> None:
    """Until every worker answered for every model."""
    seen = {}
    body = {m: json.dumps({"inputs": [[0.0] * models.SHAPES[m][0]]}).encode()
            for m in models.SHAPES}
    give_up = time.monotonic() + 300
    while len(seen) < workers * len(models.SHAPES):
        assert time.monotonic() < give_up, "warming never reached every worker"
        for m in models.SHAPES:
            conn = UnixHTTPConnection(server.uds)
            conn.request("POST", f"/v1/models/{m}/infer", body=body[m],
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            conn.close()
            seen[(r.getheader("X-Worker-Pid"), m)] = True


MODES = ("daemon", "keep0", "kept10", "inprocess")


def kept_lease_app(tmp: Path, rev: str) -> Path:
    """The example's app.py at `rev` (which kept leases for
    KEEP_LEASE_SECONDS), beside today's models.py, in a folder of its own."""
    folder = tmp / "kept-lease-app"
    folder.mkdir(exist_ok=True)
    try:
        app = subprocess.run(
            ["git", "-C", str(ROOT), "show",
             f"{rev}:examples/python/node_server/app.py"],
            check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"mode kept10 needs the example at {rev} from git: {e}")
    if b"KEEP_LEASE_SECONDS" not in app:
        raise SystemExit(f"the example at {rev} has no KEEP_LEASE_SECONDS")
    (folder / "app.py").write_bytes(app)
    (folder / "models.py").write_bytes(
        (ROOT / "examples/python/node_server/models.py").read_bytes())
    return folder


def run_one(tmp: Path, mode: str, workers: int, clients: int, requests: int,
            kept_app: "Path | None" = None) -> Dict:
    test_node_server.WORKERS = workers
    uses_daemon = mode != "inprocess"
    daemon = Daemon(tmp, tmp / "catalog.json", tmp / "models",
                    capacity="1GiB").start() if uses_daemon else None
    env = {"WEIGHTS": "inprocess" if mode == "inprocess" else "daemon",
           "MODEL_ROOT": str(tmp / "models")}
    if mode == "keep0":
        env["MODELCACHE_KEEP_IDLE"] = "0"
    if mode == "kept10":
        env["KEEP_LEASE_SECONDS"] = "10"
    fake = daemon or type("D", (), {"socket": str(tmp / "none.sock")})()
    server = Server(tmp, fake, env=env,
                    app_dir=kept_app if mode == "kept10" else None)
    try:
        warm(server, workers)
        servers = [server.proc.pid] + server.workers()
        daemon_pid = [daemon.pid] if daemon is not None else []
        cpu_before = (cpu_seconds(servers), cpu_seconds(daemon_pid))
        seconds, lat, errors = load(server.uds, clients, requests)
        cpu = (cpu_seconds(servers) - cpu_before[0],
               cpu_seconds(daemon_pid) - cpu_before[1])
        ram = sum(pss_anon(p) for p in [server.proc.pid] + server.workers())
        if daemon is not None:
            ram += daemon.get("/v1/budget")["used_bytes"]
            ram += pss_anon(daemon.pid)
        lat.sort()
        return {"rps": len(lat) / seconds, "p50_ms": lat[len(lat) // 2],
                "p99_ms": lat[int(len(lat) * 0.99)], "ram_mib": ram / 2**20,
                "server_cpu_ms": cpu[0] * 1000 / len(lat),
                "daemon_cpu_ms": cpu[1] * 1000 / len(lat), "errors": errors}
    finally:
        server.stop()
        if daemon is not None:
            daemon.stop()


def first_answer(tmp: Path, mode: str) -> Dict:
    test_node_server.WORKERS = 1
    daemon = None
    if mode == "daemon":
        daemon = Daemon(tmp, tmp / "catalog.json", tmp / "models", capacity="1GiB").start()
        status, _ = daemon.http("POST", "/v1/models/m4/load")
        assert status == 200
    else:
        (tmp / "models" / "m4.safetensors").read_bytes()  # in the page cache
    env = {"WEIGHTS": mode, "MODEL_ROOT": str(tmp / "models")}
    fake = daemon or type("D", (), {"socket": str(tmp / "none.sock")})()
    server = Server(tmp, fake, env=env)
    try:
        conn = UnixHTTPConnection(server.uds)
        t = time.perf_counter()
        conn.request("POST", "/v1/models/m4/infer",
                     body=json.dumps({"inputs": [[0.0] * 2048]}).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        total = (time.perf_counter() - t) * 1000
        assert r.status == 200
        return {"wait_ms": float(r.getheader("X-Wait-Ms")), "first_ms": total}
    finally:
        server.stop()
        if daemon is not None:
            daemon.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=800)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--modes", default="daemon,keep0,kept10,inprocess",
                   help="comma-separated, of " + ", ".join(MODES))
    p.add_argument("--kept-rev", default="0662b25",
                   help="the git revision of the example that kept leases "
                        "(mode kept10)")
    p.add_argument("--no-first-answer", action="store_true",
                   help="skip the fresh worker's first answer")
    p.add_argument("--builds", default="",
                   help="comma-separated build folders to compare, each "
                        "with bin/modelcache and python/ (default: "
                        "MODELCACHE_BUILD_DIR, else build)")
    p.add_argument("--out", default="build/bench-results/node_server.json")
    a = p.parse_args()
    builds = [b for b in a.builds.split(",") if b]
    for b in builds:
        if not (Path(b) / "bin" / "modelcache").exists():
            p.error(f"--builds: {b} has no bin/modelcache")
    modes = a.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        p.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="mc-node-bench-") as d:
        tmp = Path(d)
        total = models.write_node(tmp)
        kept_app = kept_lease_app(tmp, a.kept_rev) if "kept10" in modes else None
        print(f"models: {len(models.SHAPES)}, {total / 2**20:.1f} MiB; "
              f"{a.clients} clients, {a.requests} requests per run, median of {a.reps}")
        print(f"{'weights':>10} {'workers':>7} {'req/s':>8} {'(min-max)':>11} "
              f"{'p50 ms':>8} {'p99 ms':>8} {'RAM MiB':>8} {'CPU/req ms':>10}")
        for workers in [int(w) for w in a.workers.split(",")]:
            # Rep by rep, every mode in turn: the machine's drift falls on
            # all of them alike.
            labels = ([m] if not builds else [f"{m}@{b}" for b in builds]
                      for m in modes)
            rows = [label for group in labels for label in group]
            runs: Dict[str, List[Dict]] = {r: [] for r in rows}
            for rep in range(a.reps):
                order = builds if rep % 2 == 0 else builds[::-1]
                for build in order or [None]:
                    if build is not None:  # read by build_dir() at each start
                        os.environ["MODELCACHE_BUILD_DIR"] = build
                    for mode in modes:
                        label = mode if build is None else f"{mode}@{build}"
                        runs[label].append(run_one(tmp, mode, workers,
                                                   a.clients, a.requests,
                                                   kept_app))
            for label in rows:
                mode = label.split("@")[0]
                row = {k: statistics.median(r[k] for r in runs[label])
                       for k in ("rps", "p50_ms", "p99_ms", "ram_mib",
                                 "server_cpu_ms", "daemon_cpu_ms")}
                row.update(mode=label, workers=workers,
                           rps_runs=[r["rps"] for r in runs[label]],
                           errors=sum(r["errors"] for r in runs[label]))
                results.append(row)
                spread = f"{min(row['rps_runs']):.0f}-{max(row['rps_runs']):.0f}"
                cpu = row["server_cpu_ms"] + row["daemon_cpu_ms"]
                print(f"{label:>10} {workers:>7} {row['rps']:>8.0f} {spread:>11} "
                      f"{row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} "
                      f"{row['ram_mib']:>8.1f} {cpu:>10.2f}" +
                      (f" (daemon {row['daemon_cpu_ms']:.3f})"
                       if mode != "inprocess" else "") +
                      (f"  ({row['errors']} errors)" if row["errors"] else ""))
            for mode in modes if len(builds) > 1 else []:
                base = runs[f"{mode}@{builds[0]}"]
                for build in builds[1:]:
                    ratios = [r["rps"] / b["rps"] for r, b in
                              zip(runs[f"{mode}@{build}"], base)]
                    print(f"{mode}: {build} / {builds[0]} per rep "
                          + ", ".join(f"{x:.2f}" for x in ratios)
                          + f"; median {statistics.median(ratios):.2f}")
        first = [] if a.no_first_answer or builds else [
            m for m in ("daemon", "inprocess") if m in modes]
        if first:
            print("a fresh worker's first answer on a resident model (m4, 42 MB):")
        for mode in first:
            runs = [first_answer(tmp, mode) for _ in range(a.reps)]
            row = {k: statistics.median(r[k] for r in runs) for k in ("wait_ms", "first_ms")}
            row.update(mode=mode, first_answer=True)
            results.append(row)
            print(f"{mode:>10}: weights {row['wait_ms']:.2f} ms, "
                  f"first answer {row['first_ms']:.1f} ms")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    print("results:", a.out)


if __name__ == "__main__":
    main()
