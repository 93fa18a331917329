#!/usr/bin/python3
"""`modelcache serve` across an upgrade and a crash: how long until a node
serves again, and how many bytes it loads again, with --models models of
--model-mib MiB each (8 of 1 GiB: 8 GiB) resident. Three cases, in this
order in each repeat, each with fresh processes:

  takeover   a daemon holds every model (a client acquired each, then
             released it and closed); `modelcache serve <same flags>
             --takeover` is started beside it. Measured: from that start to
             the first served acquire by a fresh client on the new daemon
             (its ready line, connect, acquire of one model); also the old
             daemon's exit status (must be 0) and the new daemon's own
             `modelcache_takeover_seconds`.
  cold       SIGTERM to the daemon, wait for its exit, start a fresh one
             with the same flags. Measured: from that start to the first
             served acquire (connect + acquire of one model, loaded), and to
             every model resident (the others acquired at once, one thread
             each, from the same client; the daemon loads --load-slots of
             them at a time).
  reclaim    --workers processes (the Python client, reclaim on, the
             default) each hold a lease on every model (their lease objects
             stay alive); SIGKILL to the daemon; start a new one. Measured:
             from that start to every model resident again (GET /v1/models
             says READY for each, polled): the workers' clients reconnect by
             themselves and bring back each copy's memfds, and the new
             daemon adopts them. Then checked: every worker's reclaims were
             accepted, its bytes read the same, and a fresh client's acquire
             of each model is a hit.

Bytes loaded: the `modelcache_loaded_bytes_total` counter of /metrics (copies
adopted from a predecessor are not counted). For a takeover, the sum of both
daemons: the new one's counter after the first acquire, plus what the old
one loaded between the end of the setup and the successor's start (read just
before it; it cannot load once draining, and its HTTP listener is the new
daemon's after the commit). A takeover and a reclaim must load 0 bytes.

The files are written once into a temporary folder under /tmp, so they are
in the page cache: a cold restart measures the copy into memfds from the page
cache, not a disk read. Daemons listen on a UNIX socket and HTTP on
127.0.0.1 (port 0: the ready line names it). Figures are medians of --repeat
repeats. Every process is stopped by pid, also on failure. The exit status is
1 when a check failed (a takeover refused, a nonzero exit, bytes loaded where
none may be, a reclaim refused).

    PYTHONPATH=build/python /usr/bin/python3 bench/python/upgrade.py
    # a quick try:
    PYTHONPATH=build/python /usr/bin/python3 bench/python/upgrade.py \\
        --models 2 --model-mib 64 --repeat 1
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import queue
import select
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python/tests"))

import modelcache.errors  # noqa: E402
import modelcache.serve  # noqa: E402
from serve_util import die_with_parent, modelcache_binary  # noqa: E402

BOUND = 600.0  # seconds: turns a hang into a failure, never a wait
STEP = 0.005   # seconds between two polls of observable state


class CaseFailed(Exception):
    pass


# ---- models ----

def write_models(folder: Path, count: int, mib: int) -> int:
    """m0..m{count-1}, one F32 tensor of `mib` MiB each, written by hand
    (u64 LE header length, JSON header, data); element k of model i is
    i * 1024 + k % 1024, so a reader can check what it maps. Returns the
    data bytes of one model."""
    models = folder / "models"
    models.mkdir(parents=True)
    nbytes = mib << 20
    elements = nbytes // 4
    chunk = min(elements, 16 << 20)  # 64 MiB of float32 at a time
    base = (np.arange(chunk, dtype=np.uint32) % 1024).astype(np.float32)
    for i in range(count):
        header = {"weight": {"dtype": "F32", "shape": [elements],
                             "data_offsets": [0, nbytes]}}
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        data = (base + np.float32(i * 1024)).tobytes()
        with open(models / f"m{i}.safetensors", "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            left = nbytes
            while left:
                n = min(left, len(data))
                f.write(data[:n])
                left -= n
    (folder / "catalog.json").write_text(json.dumps({"models": [
        {"id": f"m{i}", "files": [f"m{i}.safetensors"]} for i in range(count)]}))
    return nbytes


def expected_heads(i: int, elements: int) -> List[float]:
    return [float(i * 1024), float(i * 1024 + (elements - 1) % 1024)]


# ---- the daemon ----

class Daemon:
    """One `modelcache serve` process, started with a ready pipe."""

    def __init__(self, proc: subprocess.Popen, ready: Dict[str, Any],
                 log: Path) -> None:
        self.proc = proc
        self.ready = ready
        self.log = log
        host, _, port = ready["http"].rpartition(":")
        self.host, self.port = host, int(port)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def http(self, method: str, url: str) -> "tuple[int, bytes]":
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request(method, url)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def get(self, url: str) -> Any:
        status, body = self.http("GET", url)
        if status != 200:
            raise CaseFailed(f"GET {url}: {status} {body[:200]!r}")
        return json.loads(body) if url != "/metrics" else body.decode()

    def metrics(self) -> Dict[str, float]:
        out = {}
        for line in self.get("/metrics").splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def loaded_bytes(self) -> int:
        return int(self.metrics().get("modelcache_loaded_bytes_total", 0))

    def acquires(self) -> int:
        return int(sum(v for k, v in self.metrics().items()
                       if k.startswith("modelcache_acquires_total")))


class Node:
    """The flags every daemon of a run shares, and each process started."""

    def __init__(self, tmp: Path, capacity: str, extra: List[str]) -> None:
        self.tmp = tmp
        self.socket = str(tmp / "run" / "serve.sock")
        self.args = [str(modelcache_binary()), "serve",
                     "--catalog", str(tmp / "catalog.json"),
                     "--model-root", str(tmp / "models"),
                     "--socket", self.socket,
                     "--host-capacity", capacity,
                     "--http", "127.0.0.1:0"] + extra
        self.procs: List[subprocess.Popen] = []
        self.started = 0

    def start(self, takeover: bool = False) -> Daemon:
        """Starts a daemon and returns once its ready line came; raises
        CaseFailed (the process stopped) when it exits without one."""
        self.started += 1
        log = self.tmp / f"daemon-{self.started}.log"
        ready_r, ready_w = os.pipe()
        args = self.args + ["--ready-fd", str(ready_w)]
        if takeover:
            args.append("--takeover")
        with open(log, "wb") as f:
            proc = subprocess.Popen(args, pass_fds=[ready_w], stdout=f,
                                    stderr=f, preexec_fn=die_with_parent)
        self.procs.append(proc)
        os.close(ready_w)
        line = b""
        give_up = time.monotonic() + BOUND
        with os.fdopen(ready_r, "rb", buffering=0) as r:
            while not line.endswith(b"\n") and time.monotonic() < give_up:
                if select.select([r], [], [], 1.0)[0]:
                    data = r.read(4096)
                    if not data:
                        break
                    line += data
        if not line.endswith(b"\n"):
            stop(proc)
            raise CaseFailed(
                f"daemon{' --takeover' if takeover else ''} did not get ready "
                f"(exit status {proc.returncode}): " + tail(log))
        return Daemon(proc, json.loads(line), log)

    def stop_all(self) -> None:
        for proc in self.procs:
            stop(proc)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> Optional[int]:
    """Ends `proc` by pid if it still runs: `sig`, then SIGKILL after 30 s."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, sig)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        except ProcessLookupError:
            proc.wait(timeout=30)
    return proc.returncode


def tail(log: Path, lines: int = 12) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_until(condition, what: str, bound: float = BOUND) -> None:
    give_up = time.monotonic() + bound
    while not condition():
        if time.monotonic() > give_up:
            raise CaseFailed("never: " + what)
        time.sleep(STEP)


def acquire_each(socket: str, ids: List[str], parallel: bool) -> List[str]:
    """A fresh client acquires (and releases) each model; returns each
    acquire's `load`."""
    client = modelcache.serve.connect(socket, connect_timeout=30, keep_idle=0)
    try:
        def one(m: str) -> str:
            with client.acquire(m, timeout=BOUND) as lease:
                return lease.load
        if parallel and len(ids) > 1:
            with concurrent.futures.ThreadPoolExecutor(len(ids)) as pool:
                return list(pool.map(one, ids))
        return [one(m) for m in ids]
    finally:
        client.close()


# ---- the workers of the reclaim case ----

WORKER = r"""
import json, sys
import modelcache.serve
socket, ids = sys.argv[1], sys.argv[2].split(",")
client = modelcache.serve.connect(socket, connect_timeout=30)
leases = [client.acquire(m, timeout=600) for m in ids]
def heads():
    out = []
    for lease in leases:
        a = lease.numpy("weight")
        out.append([float(a[0]), float(a[-1])])
    return out
print(json.dumps({"loads": [l.load for l in leases], "heads": heads()}), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "reclaims":
        print(json.dumps(client.reclaims()), flush=True)
    elif cmd == "heads":
        print(json.dumps(heads()), flush=True)
    else:
        break
"""


class Worker:
    def __init__(self, node: Node, index: int, ids: List[str]) -> None:
        self.log = node.tmp / f"worker-{index}.log"
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", WORKER, node.socket, ",".join(ids)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f,
                preexec_fn=die_with_parent)
        node.procs.append(self.proc)
        self.lines: "queue.Queue[Optional[bytes]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def reply(self, bound: float = BOUND) -> Any:
        try:
            line = self.lines.get(timeout=bound)
        except queue.Empty:
            line = None
        if line is None:
            raise CaseFailed(f"worker {self.proc.pid} did not answer: " +
                             tail(self.log))
        return json.loads(line)

    def ask(self, command: str) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()
        return self.reply()

    def quit(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        stop(self.proc)


# ---- one repeat: the three cases in a row ----

def one_repeat(node: Node, ids: List[str], elements: int, workers: int,
               failures: List[str]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    # Setup: every model resident, nobody holding it.
    d = node.start()
    acquire_each(node.socket, ids, parallel=True)
    after_setup = d.loaded_bytes()

    # 1. takeover
    try:
        before = d.loaded_bytes()
        t0 = time.monotonic()
        new = node.start(takeover=True)
        t_ready = time.monotonic() - t0
        served_before = new.acquires()
        load = acquire_each(node.socket, ids[:1], parallel=False)[0]
        t_first = time.monotonic() - t0
        try:
            old_status = d.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            old_status = None
        m = new.metrics()
        served = new.acquires() - served_before
        loaded = (before - after_setup) + int(m.get("modelcache_loaded_bytes_total", 0))
        out["takeover"] = {"ready_s": t_ready, "first_s": t_first, "bytes": loaded,
                           "old_exit": old_status, "load": load,
                           "takeover_s": m.get("modelcache_takeover_seconds")}
        if old_status != 0:
            failures.append(f"takeover: the old daemon's exit status is {old_status}")
        if loaded != 0:
            failures.append(f"takeover: {loaded} bytes loaded")
        if load != "hit" or served < 1:
            failures.append(f"takeover: the first acquire was {load!r}, "
                            f"{served} acquires served by the new daemon")
        d = new
    except CaseFailed as e:
        failures.append(f"takeover: {e}")
        if d.proc.poll() is not None:  # the old one did not serve on
            raise

    # 2. cold restart
    status = stop(d.proc, signal.SIGTERM)
    if status != 0:
        failures.append(f"cold: the daemon exited {status} on SIGTERM")
    t0 = time.monotonic()
    d = node.start()
    t_ready = time.monotonic() - t0
    first = acquire_each(node.socket, ids[:1], parallel=False)
    t_first = time.monotonic() - t0
    first_bytes = d.loaded_bytes()
    rest = acquire_each(node.socket, ids[1:], parallel=True) if len(ids) > 1 else []
    t_all = time.monotonic() - t0
    loaded = d.loaded_bytes()
    out["cold"] = {"ready_s": t_ready, "first_s": t_first, "all_s": t_all,
                   "first_bytes": first_bytes, "bytes": loaded,
                   "loads": first + rest}

    # 3. reclaim after SIGKILL
    ws = [Worker(node, i, ids) for i in range(workers)]
    try:
        heads = [w.reply() for w in ws]
        want = [expected_heads(i, elements) for i in range(len(ids))]
        for h in heads:
            if h["heads"] != want:
                raise CaseFailed(f"a worker read {h['heads']}, not {want}")
        stop(d.proc, signal.SIGKILL)
        t0 = time.monotonic()
        d = node.start()
        t_ready = time.monotonic() - t0

        def resident() -> bool:
            return all(m["state"] == "READY" for m in d.get("/v1/models")["models"])
        wait_until(resident, "every model resident after the reclaims")
        t_all = time.monotonic() - t0
        for w in ws:
            def reclaimed(w: Worker = w) -> bool:
                r = w.ask("reclaims")
                if r["reclaim_refused"] or r["reclaim_unsupported"]:
                    raise CaseFailed(f"worker {w.proc.pid}: reclaims {r}")
                return r["reclaimed"] == len(ids) and r["pending"] == 0
            wait_until(reclaimed, f"worker {w.proc.pid} reclaimed every lease", 60)
            if w.ask("heads") != want:
                raise CaseFailed(f"worker {w.proc.pid} reads other bytes after the reclaim")
        loads = acquire_each(node.socket, ids, parallel=False)
        m = d.metrics()
        loaded = int(m.get("modelcache_loaded_bytes_total", 0))
        out["reclaim"] = {
            "ready_s": t_ready, "all_s": t_all, "bytes": loaded, "loads": loads,
            "accepted": m.get('modelcache_reclaims_total{result="accepted"}'),
            "refused": m.get('modelcache_reclaims_total{result="refused"}'),
            "orphaned": m.get("modelcache_orphaned_bytes")}
        if loaded != 0:
            failures.append(f"reclaim: {loaded} bytes loaded")
        if any(x != "hit" for x in loads):
            failures.append(f"reclaim: a fresh client's acquires were {loads}")
        if out["reclaim"]["refused"]:
            failures.append(f"reclaim: {out['reclaim']['refused']:.0f} reclaims refused")
    except CaseFailed as e:
        failures.append(f"reclaim: {e}")
    finally:
        for w in ws:
            w.quit()
    status = stop(d.proc, signal.SIGTERM)
    if status != 0:
        failures.append(f"the last daemon exited {status} on SIGTERM")
    return out


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    if n == 0:
        return "0"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=int, default=8)
    p.add_argument("--model-mib", type=int, default=1024)
    p.add_argument("--workers", type=int, default=2,
                   help="processes holding every model in the reclaim case")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--host-capacity", default="12GiB")
    p.add_argument("--daemon-args", default="",
                   help="more flags for every daemon, one string (shell words)")
    p.add_argument("--out", default="build/bench-results/upgrade.json")
    a = p.parse_args()
    if a.models < 1 or a.model_mib < 1 or a.repeat < 1 or a.workers < 1:
        p.error("--models, --model-mib, --workers and --repeat must be >= 1")
    if not modelcache_binary().exists():
        raise SystemExit(f"{modelcache_binary()} is missing: build it first (make)")
    ids = [f"m{i}" for i in range(a.models)]
    runs: List[Dict[str, Any]] = []
    failures: List[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="mc-upgrade-bench-", dir="/tmp"))
    try:
        nbytes = write_models(tmp, a.models, a.model_mib)
        total = nbytes * a.models
        print(f"models: {a.models} x {fmt_bytes(nbytes)} = {fmt_bytes(total)}; "
              f"{a.workers} reclaiming workers; host capacity {a.host_capacity}; "
              f"median of {a.repeat}", flush=True)
        for r in range(a.repeat):
            node = Node(tmp, a.host_capacity, shlex.split(a.daemon_args))
            before = len(failures)
            try:
                runs.append(one_repeat(node, ids, nbytes // 4, a.workers, failures))
            except (CaseFailed, modelcache.errors.Error, OSError) as e:
                failures.append(f"repeat {r + 1}: {type(e).__name__}: {e}")
            finally:
                node.stop_all()
                for f in failures[before:]:
                    print("  FAILED", f, flush=True)
                if failures[before:]:
                    for log in sorted(tmp.glob("*.log")):
                        print(f"  --- {log.name}:\n" + tail(log), flush=True)
                # The next repeat starts on an empty socket folder (no record).
                shutil.rmtree(tmp / "run", ignore_errors=True)
                for log in tmp.glob("*.log"):
                    log.unlink()
            if runs and len(runs) == r + 1:
                print(f"  repeat {r + 1}: " + json.dumps(runs[-1]), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def med(case: str, key: str) -> Optional[float]:
        xs = [run[case][key] for run in runs
              if case in run and run[case].get(key) is not None]
        return statistics.median(xs) if xs else None

    rows = [("takeover", "first acquire", "takeover", "first_s", "bytes"),
            ("cold restart", "first acquire", "cold", "first_s", "first_bytes"),
            ("cold restart", f"all {a.models} resident", "cold", "all_s", "bytes"),
            ("reclaim after SIGKILL", f"all {a.models} resident", "reclaim", "all_s",
             "bytes")]
    print(f"\n{'case':<22} {'until':<16} {'ready s':>8} {'seconds':>8} {'bytes loaded':>13}")
    for label, until, case, key, bkey in rows:
        s, ready, b = med(case, key), med(case, "ready_s"), med(case, bkey)
        print(f"{label:<22} {until:<16} "
              f"{'-' if ready is None else f'{ready:.3f}':>8} "
              f"{'-' if s is None else f'{s:.3f}':>8} {fmt_bytes(b):>13}")
    exits = [run["takeover"]["old_exit"] for run in runs if "takeover" in run]
    own = med("takeover", "takeover_s")
    print(f"takeover: the old daemon's exit status {exits}; the new daemon's "
          f"modelcache_takeover_seconds (median) "
          f"{'-' if own is None else f'{own:.3f}'}")
    print("ready s: from the start of the process to its ready line; seconds: "
          "to the event named in 'until'")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"models": a.models, "model_mib": a.model_mib,
                                       "workers": a.workers, "runs": runs,
                                       "failures": failures}, indent=1))
    print("results:", a.out)
    if failures:
        print(f"{len(failures)} checks FAILED:")
        for f in failures:
            print("  " + f)
        sys.exit(1)


if __name__ == "__main__":
    main()
