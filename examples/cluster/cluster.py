#!/usr/bin/python3
"""A modelcache cluster on loopback, measured against `modelcache replay --nodes`.

    /usr/bin/python3 examples/cluster/cluster.py            # `make cluster`
    /usr/bin/python3 examples/cluster/cluster.py --quick    # the version in `make test`

It starts everything itself and stops everything it started, by pid, also
when it fails or is interrupted (every child also gets PR_SET_PDEATHSIG):

- N nodes (4), node k on 127.0.0.(k+1): a `modelcache serve` daemon (HTTP
  API and /metrics on port P+1) and the example worker of
  examples/python/node_server (FastAPI under uvicorn, port P), leasing its
  weights from that daemon. The daemon's load throttle makes every load take
  latency + bytes / bandwidth through one load slot, and the worker's
  SERVICE_MS holds each request for a fixed time, so that the time model
  replay needs is known rather than guessed.
- HAProxy in front (127.0.0.1:P+2), from examples/cluster/haproxy.cfg.in:
  one route at a time, health checks on /readyz, retries with redispatch and
  retry-on 503, fixed server ids and weights; its Prometheus exporter on
  P+3.
- A real Prometheus server (127.0.0.1:P+4, examples/cluster/prometheus.yml.in)
  scraping every daemon's /metrics and HAProxy's exporter.
- A client replaying a trace in `modelcache replay`'s CSV format (t_ms,
  model, duration_ms) through HAProxy with at most C requests out at once.

The runs, each on cold caches (every model unloaded through the daemons'
admin sockets between runs):

1. `golden`: `chash` at concurrency 1; every response's X-Node must be the
   owner `modelcache ring` prints for its model. Its hits also give the time
   a request holds its node (the worker's SERVICE_MS plus the HTTP path),
   which becomes the trace's duration_ms for the predictions.
2. One run per route at concurrency C (4), each beside `modelcache replay
   --nodes` on the same trace with the same time model.
3. `kill`: `chash-bl` at concurrency 1 with one node SIGKILLed (daemon and
   worker) at 40% of the trace and started again, cold, at 70%.

What it checks (exit status 1, each failure named, when one does not hold):

- budget: no node over its capacity, from /v1/budget sampled during every
  run, each daemon's high-water mark, and Prometheus' max_over_time;
- affinity pays: `chash` loads at most half of `roundrobin`'s;
- the ring is HAProxy's: the golden run above;
- replay predicts the cluster (`chash-bl`): total loads within 10%, each
  node's request share within 3 points, p99 wait within 25%;
- a death moves one node's models: the models loaded away from their owner
  while the node is dead are the moved set of `modelcache ring --kill`
  (those of them requested then), every request in that window goes where
  `ring --kill` says, and no request fails;
- a hot model spreads, a cold one does not (`chash-bl`): the hottest model
  is loaded on at least 2 nodes, the median model on 1;
- Prometheus agrees: the sum over nodes of modelcache_loads_total queried
  from Prometheus' HTTP API equals the daemons' own counts, and HAProxy's
  per-server response counts equal the X-Node counts the client saw.

Every run writes its JSON (measured, predicted, the commands) under
--out (build/cluster-results/), and summary.json and summary.md there.
"""

from __future__ import annotations

import argparse
import atexit
import bisect
import csv
import ctypes
import http.client
import json
import math
import os
import random
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
NODE_SERVER = REPO / "examples/python/node_server"
sys.path.insert(0, str(NODE_SERVER))
import models  # noqa: E402  (the example's models: writes the catalog)

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


class ClusterError(Exception):
    """A set-up failure: a port taken, a process that did not start."""


# ---------------------------------------------------------------------------
# Processes: every child is registered here and stopped by pid.


def _die_with_parent() -> None:
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Processes:
    """Every process this script started; stop_all() ends each by pid
    (SIGTERM, then SIGKILL after a grace period). Children get
    PR_SET_PDEATHSIG, so they die with this script even if it is SIGKILLed;
    they are started from the main thread only, since the signal follows
    the thread that forked them."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self._procs: Dict[int, Tuple[str, subprocess.Popen]] = {}

    def start(self, name: str, args: Sequence[str], *,
              env: Optional[Dict[str, str]] = None, pass_fds: Sequence[int] = (),
              cwd: Optional[Path] = None) -> subprocess.Popen:
        assert threading.current_thread() is threading.main_thread()
        log = open(self.logs / f"{name}.log", "ab")
        try:
            proc = subprocess.Popen(list(args), env=env, pass_fds=list(pass_fds),
                                    stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=cwd,
                                    preexec_fn=_die_with_parent)
        finally:
            log.close()
        self._procs[proc.pid] = (name, proc)
        return proc

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.logs / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL, as a crash would end it."""
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        self._procs.pop(proc.pid, None)

    def stop(self, proc: subprocess.Popen, grace: float = 5.0) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.pop(proc.pid, None)

    def stop_all(self) -> None:
        procs = list(self._procs.values())
        for _, proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 5
        for _, proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()

    def running(self) -> List[int]:
        return [pid for pid, (_, p) in self._procs.items() if p.poll() is None]


def wait_for(what: str, ready: Callable[[], bool], timeout: float,
             alive: Callable[[], Optional[str]] = lambda: None,
             period: float = 0.05) -> None:
    """Polls `ready` (an external process's readiness: uvicorn, HAProxy and
    Prometheus have no readiness descriptor) until it holds; raises
    ClusterError naming `what` after `timeout`, or at once when `alive`
    reports a reason (the process exited)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ready():
                return
        except (OSError, http.client.HTTPException, ValueError):
            pass
        gone = alive()
        if gone:
            raise ClusterError(f"{what}: {gone}")
        if time.monotonic() > deadline:
            raise ClusterError(f"{what}: not ready after {timeout:.0f} s")
        time.sleep(period)


# ---------------------------------------------------------------------------
# HTTP helpers (loopback TCP and the daemons' admin UNIX sockets).


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def http_get(host: str, port: int, path: str, timeout: float = 5.0
             ) -> Tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def http_json(host: str, port: int, path: str) -> Any:
    status, body = http_get(host, port, path)
    if status != 200:
        raise ClusterError(f"GET http://{host}:{port}{path}: {status} {body[:200]!r}")
    return json.loads(body)


def admin(socket_path: str, method: str, path: str,
          body: Optional[bytes] = None) -> Tuple[int, Any]:
    conn = _UnixHTTP(socket_path, timeout=30)
    try:
        conn.request(method, path, body=body)
        r = conn.getresponse()
        data = r.read()
        return r.status, json.loads(data) if data else None
    finally:
        conn.close()


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def metric_sum(text: str, name: str) -> float:
    """The sum of a Prometheus text-format metric's samples."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---------------------------------------------------------------------------
# The parts of the cluster.


class Settings:
    """What every run shares: the catalog, the nodes' budget and time model,
    the addresses."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.build = Path(args.build).resolve()
        self.modelcache = self.build / "bin" / "modelcache"
        self.python_path = str(self.build / "python")
        self.tmp = tmp
        self.nodes = args.nodes
        self.port = args.base_port
        self.capacity = args.capacity
        self.bandwidth = args.load_bandwidth
        self.latency = args.load_latency
        self.service_ms = args.service_ms
        self.zipf = args.zipf
        self.check_inter_ms = 500
        self.timeout_connect_ms = 100
        self.retries = 3
        self.catalog_models = models.family(args.models)
        self.model_root = tmp / "node" / "models"
        self.catalog = tmp / "node" / "catalog.json"

    def addr(self, k: int) -> str:
        """Node k's loopback address (k from 1)."""
        return f"127.0.0.{k + 1}"

    def name(self, k: int) -> str:
        return f"n{k}"

    def ring_nodes(self) -> str:
        """The servers as `modelcache ring` and replay take them."""
        return ",".join(f"{self.name(k)}:{k}:100" for k in range(1, self.nodes + 1))

    def frontend(self) -> Tuple[str, int]:
        return "127.0.0.1", self.port + 2

    def check_ports(self) -> None:
        wanted = [(self.addr(k), self.port + d)
                  for k in range(1, self.nodes + 1) for d in (0, 1)]
        wanted += [("127.0.0.1", self.port + d) for d in (2, 3, 4)]
        for host, port in wanted:
            if not port_free(host, port):
                raise ClusterError(f"port {host}:{port} is taken (choose "
                                   "another --base-port)")


class Node:
    """One node: a `modelcache serve` daemon and one example worker."""

    def __init__(self, s: Settings, procs: Processes, k: int) -> None:
        self.s, self.procs, self.k = s, procs, k
        self.name = s.name(k)
        self.addr = s.addr(k)
        self.http_port = s.port + 1
        self.dir = s.tmp / self.name
        self.socket = str(self.dir / "run" / "serve.sock")
        self.admin = self.socket + ".admin"
        self.daemon: Optional[subprocess.Popen] = None
        self.worker: Optional[subprocess.Popen] = None
        self.starts = 0

    def start(self) -> None:
        """Starts the daemon (waiting on its --ready-fd) and the worker."""
        self.starts += 1
        self.dir.mkdir(parents=True, exist_ok=True)
        tag = f"{self.name}-{self.starts}"
        ready_r, ready_w = os.pipe()
        try:
            self.daemon = self.procs.start(f"{tag}-daemon", [
                str(self.s.modelcache), "serve",
                "--catalog", str(self.s.catalog),
                "--model-root", str(self.s.model_root),
                "--socket", self.socket,
                "--http", f"{self.addr}:{self.http_port}",
                "--host-capacity", self.s.capacity,
                "--policy", "lru", "--load-slots", "1",
                "--throttle-load-bandwidth", self.s.bandwidth,
                "--throttle-load-latency", self.s.latency,
                "--ready-grace", "0s", "--ready-fd", str(ready_w)],
                pass_fds=[ready_w])
        finally:
            os.close(ready_w)
        with os.fdopen(ready_r, "rb") as r:
            line = r.readline()
        if not line:
            raise ClusterError(f"{self.name}: the daemon did not start:\n"
                               + self.procs.log_tail(f"{tag}-daemon"))
        env = dict(os.environ,
                   PYTHONPATH=f"{self.s.python_path}:{NODE_SERVER}",
                   MODELCACHE_SOCKET=self.socket, NODE_NAME=self.name,
                   DAEMON_HTTP=f"{self.addr}:{self.http_port}",
                   MODELCACHE_KEEP_IDLE="0", SERVICE_MS=str(self.s.service_ms),
                   ACQUIRE_TIMEOUT="60", OMP_NUM_THREADS="1")
        self.worker = self.procs.start(f"{tag}-worker", [
            sys.executable, "-m", "uvicorn", "app:app", "--host", self.addr,
            "--port", str(self.s.port), "--no-access-log",
            "--log-level", "warning"], env=env, cwd=NODE_SERVER)

    def wait_ready(self) -> None:
        tag = f"{self.name}-{self.starts}"

        def alive() -> Optional[str]:
            for proc, what in ((self.daemon, "daemon"), (self.worker, "worker")):
                if proc is not None and proc.poll() is not None:
                    return (f"the {what} exited with {proc.returncode}:\n"
                            + self.procs.log_tail(f"{tag}-{what}"))
            return None

        wait_for(f"{self.name}'s worker on {self.addr}:{self.s.port}",
                 lambda: http_get(self.addr, self.s.port, "/readyz", 2)[0] == 200,
                 timeout=120, alive=alive)

    def kill(self) -> None:
        for proc in (self.worker, self.daemon):
            if proc is not None:
                self.procs.kill(proc)
        self.worker = self.daemon = None

    def models(self) -> Dict[str, Dict[str, Any]]:
        listing = http_json(self.addr, self.http_port, "/v1/models")["models"]
        return {m["id"]: m for m in listing}

    def budget(self) -> Dict[str, Any]:
        return http_json(self.addr, self.http_port, "/v1/budget")

    def loads_metric(self) -> float:
        status, body = http_get(self.addr, self.http_port, "/metrics")
        if status != 200:
            raise ClusterError(f"{self.name}: /metrics answered {status}")
        return metric_sum(body.decode(), "modelcache_loads_total")

    def unload_all(self) -> None:
        """Every model out (none is leased between runs: the workers keep no
        lease), then waits until the budget shows nothing in use."""
        for model_id, m in self.models().items():
            if m["state"] == "READY":
                status, body = admin(self.admin, "POST",
                                     f"/v1/models/{model_id}/unload")
                if status != 200:
                    raise ClusterError(f"{self.name}: unload {model_id}: "
                                       f"{status} {body}")
        wait_for(f"{self.name}: budget empty after unloading",
                 lambda: self.budget()["used_bytes"] == 0, timeout=30)


class Haproxy:
    def __init__(self, s: Settings, procs: Processes) -> None:
        self.s, self.procs = s, procs
        self.proc: Optional[subprocess.Popen] = None
        self.stats_socket = str(s.tmp / "haproxy.sock")
        self.runs = 0

    @staticmethod
    def balance(route: str) -> str:
        """HAProxy's backend lines for one of replay's routes."""
        chash = "  balance hash path,field(4,/)\n  hash-type consistent"
        if route == "roundrobin":
            return "  balance roundrobin"
        if route == "leastconn":
            return "  balance leastconn"
        if route == "random":
            return "  balance random(1)"
        if route == "p2c":
            return "  balance random(2)"
        if route == "chash":
            return chash
        if route == "chash-map":
            return "  balance hash path,field(4,/)\n  hash-type map-based"
        if route.startswith("chash-bl:"):
            return chash + f"\n  hash-balance-factor {int(route[9:])}"
        raise ValueError(f"unknown route {route!r}")

    def config(self, route: str) -> str:
        servers = "\n".join(
            f"  server {self.s.name(k)} {self.s.addr(k)}:{self.s.port} "
            f"id {k} weight 100" for k in range(1, self.s.nodes + 1))
        host, port = self.s.frontend()
        template = string.Template((HERE / "haproxy.cfg.in").read_text())
        return template.substitute(
            stats_socket=self.stats_socket,
            timeout_connect=f"{self.s.timeout_connect_ms}ms",
            retries=self.s.retries,
            stats_bind=f"127.0.0.1:{self.s.port + 3}",
            bind=f"{host}:{port}",
            balance=self.balance(route),
            check_inter=f"{self.s.check_inter_ms}ms",
            servers=servers)

    def start(self, route: str) -> None:
        self.stop()
        self.runs += 1
        cfg = self.s.tmp / f"haproxy-{self.runs}.cfg"
        cfg.write_text(self.config(route))
        check = subprocess.run(["haproxy", "-c", "-q", "-f", str(cfg)],
                               capture_output=True, text=True)
        if check.returncode != 0:
            raise ClusterError(f"haproxy -c {cfg}: {check.stdout}{check.stderr}")
        name = f"haproxy-{self.runs}"
        self.proc = self.procs.start(name, ["haproxy", "-db", "-f", str(cfg)])

        def alive() -> Optional[str]:
            if self.proc.poll() is not None:
                return f"exited with {self.proc.returncode}:\n" + self.procs.log_tail(name)
            return None

        wait_for("haproxy: every server UP",
                 lambda: self.servers_up() == self.s.nodes, timeout=60, alive=alive)

    def stat(self) -> List[Dict[str, str]]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(self.stats_socket)
            sock.sendall(b"show stat\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        lines = data.decode().lstrip("# ").splitlines()
        return [row for row in csv.DictReader(lines) if row.get("pxname") == "nodes"]

    def servers_up(self) -> int:
        return sum(1 for row in self.stat()
                   if row["svname"] not in ("FRONTEND", "BACKEND")
                   and row["status"].startswith("UP"))

    def server_up(self, name: str) -> bool:
        return any(row["svname"] == name and row["status"].startswith("UP")
                   for row in self.stat())

    def stop(self) -> None:
        if self.proc is not None:
            self.procs.stop(self.proc)
            self.proc = None


class Prometheus:
    def __init__(self, s: Settings, procs: Processes) -> None:
        self.s, self.procs = s, procs
        self.port = s.port + 4
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        targets = "\n".join(
            f'      - targets: ["{self.s.addr(k)}:{self.s.port + 1}"]\n'
            f'        labels: {{node: "{self.s.name(k)}"}}'
            for k in range(1, self.s.nodes + 1))
        template = string.Template((HERE / "prometheus.yml.in").read_text())
        cfg = self.s.tmp / "prometheus.yml"
        cfg.write_text(template.substitute(
            scrape_interval="500ms", node_targets=targets,
            haproxy_target=f"127.0.0.1:{self.s.port + 3}"))
        if shutil.which("promtool"):
            check = subprocess.run(["promtool", "check", "config", str(cfg)],
                                   capture_output=True, text=True)
            if check.returncode != 0:
                raise ClusterError(f"promtool check config: {check.stdout}{check.stderr}")
        self.proc = self.procs.start("prometheus", [
            "prometheus", f"--config.file={cfg}",
            f"--storage.tsdb.path={self.s.tmp / 'prometheus-data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1d", "--log.level=warn"])

        def alive() -> Optional[str]:
            if self.proc.poll() is not None:
                return f"exited with {self.proc.returncode}:\n" + self.procs.log_tail("prometheus")
            return None

        wait_for("prometheus", lambda: http_get("127.0.0.1", self.port, "/-/ready", 2)[0] == 200,
                 timeout=60, alive=alive)

    def query(self, expr: str) -> List[Dict[str, Any]]:
        path = "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        body = http_json("127.0.0.1", self.port, path)
        if body.get("status") != "success":
            raise ClusterError(f"prometheus query {expr!r}: {body}")
        return body["data"]["result"]

    def scraped_since(self, since: float, jobs: Dict[str, int]) -> bool:
        """Whether each job's targets (job -> how many) all have a sample
        taken after `since` (Unix seconds)."""
        for job, count in jobs.items():
            # timestamp() of a bare selector is each sample's scrape time.
            rows = self.query(f'timestamp(up{{job="{job}"}})')
            fresh = [r for r in rows if float(r["value"][1]) > since]
            if len(fresh) < count:
                return False
        return True

    def wait_scraped_since(self, since: float, jobs: Dict[str, int]) -> None:
        wait_for("prometheus: a scrape of every target after the run",
                 lambda: self.scraped_since(since, jobs), timeout=30,
                 period=0.1)


# ---------------------------------------------------------------------------
# Traces and the client.


class Request:
    __slots__ = ("i", "t_ms", "model", "status", "node", "load", "wait_ms",
                 "sent", "done", "error")

    def __init__(self, i: int, t_ms: float, model: str) -> None:
        self.i, self.t_ms, self.model = i, t_ms, model
        self.status = 0
        self.node = self.load = self.error = ""
        self.wait_ms = math.nan
        self.sent = self.done = math.nan


def zipf_trace(model_ids: Sequence[str], count: int, exponent: float,
               rate: float, seed: int) -> List[Tuple[float, str]]:
    """`count` requests, model popularity Zipf(exponent) over a seeded
    shuffle of the ids (so popularity is not the catalog order); arrivals
    Poisson at `rate` per second, or all at 0 (closed loop) when 0."""
    rng = random.Random(seed)
    ids = list(model_ids)
    rng.shuffle(ids)
    weights = [1 / (r + 1) ** exponent for r in range(len(ids))]
    cumulative = []
    total = 0.0
    for w in weights:
        total += w
        cumulative.append(total)
    t = 0.0
    out = []
    for _ in range(count):
        if rate > 0:
            t += rng.expovariate(rate) * 1000
        m = ids[min(bisect.bisect_left(cumulative, rng.random() * total), len(ids) - 1)]
        out.append((t, m))
    return out


def write_trace(path: Path, trace: Sequence[Tuple[float, str]], duration_ms: float) -> None:
    with open(path, "w") as f:
        f.write("t_ms,model,duration_ms\n")
        for t, m in trace:
            f.write(f"{t:.3f},{m},{duration_ms:.3f}\n")


class Client:
    """Sends a trace through HAProxy: `concurrency` threads, each taking the
    next request in trace order and sending it no earlier than its t_ms after
    the start (an open loop capped at `concurrency` requests out at once,
    which is what replay's --concurrency models). `on_sent(i)` runs before
    request i is sent."""

    def __init__(self, host: str, port: int, concurrency: int) -> None:
        self.host, self.port, self.concurrency = host, port, concurrency
        inputs = [[0.01 * j for j in range(models.FAMILY_INPUT)]]
        self.body = json.dumps({"inputs": inputs}).encode()
        self.started_at = time.monotonic()

    def run(self, trace: Sequence[Tuple[float, str]],
            on_sent: Callable[[int], None] = lambda i: None) -> List[Request]:
        requests = [Request(i, t, m) for i, (t, m) in enumerate(trace)]
        lock = threading.Lock()
        cursor = [0]
        start = self.started_at = time.monotonic()

        def worker() -> None:
            conn: Optional[http.client.HTTPConnection] = None
            while True:
                with lock:
                    i = cursor[0]
                    if i >= len(requests):
                        break
                    cursor[0] += 1
                r = requests[i]
                delay = start + r.t_ms / 1000 - time.monotonic()
                if delay > 0:
                    time.sleep(delay)  # the trace's arrival time
                on_sent(i)
                r.sent = time.monotonic() - start
                try:
                    if conn is None:
                        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
                    conn.request("POST", f"/v1/models/{r.model}/infer", body=self.body,
                                 headers={"Content-Type": "application/json"})
                    resp = conn.getresponse()
                    resp.read()
                    r.status = resp.status
                    r.node = resp.getheader("X-Node", "")
                    r.load = resp.getheader("X-Load", "")
                    r.wait_ms = float(resp.getheader("X-Wait-Ms", "nan"))
                    if resp.getheader("Connection", "").lower() == "close":
                        conn.close()
                        conn = None
                except (OSError, http.client.HTTPException) as e:
                    r.error = f"{type(e).__name__}: {e}"
                    if conn is not None:
                        conn.close()
                    conn = None
                r.done = time.monotonic() - start
            if conn is not None:
                conn.close()

        threads = [threading.Thread(target=worker, name=f"client-{c}")
                   for c in range(self.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return requests


class BudgetSampler:
    """Samples every daemon's /v1/budget while a run goes on."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        self.nodes = nodes
        self.max_used: Dict[str, int] = {n.name: 0 for n in nodes}
        self.capacity: Dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="budget-sampler")

    def _run(self) -> None:
        while not self._stop.is_set():
            for n in self.nodes:
                if n.daemon is None:
                    continue
                try:
                    b = n.budget()
                except (OSError, ClusterError, http.client.HTTPException, ValueError):
                    continue  # a node being killed
                self.max_used[n.name] = max(self.max_used[n.name], b["used_bytes"])
                self.capacity[n.name] = b["capacity_bytes"]
                self.samples += 1
            self._stop.wait(0.05)

    def __enter__(self) -> "BudgetSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def percentile(values: Sequence[float], q: float) -> float:
    """Linear between the closest ranks, as replay computes its waits'."""
    if not values:
        return 0.0
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


# ---------------------------------------------------------------------------
# The cluster and its runs.


class Cluster:
    def __init__(self, s: Settings, procs: Processes, out: Path) -> None:
        self.s, self.procs, self.out = s, procs, out
        self.nodes = [Node(s, procs, k) for k in range(1, s.nodes + 1)]
        self.haproxy = Haproxy(s, procs)
        self.prometheus = Prometheus(s, procs)
        self.sizes: Dict[str, int] = {}
        self.failures: List[str] = []
        self.checks: List[Dict[str, Any]] = []
        self.hold_ms = float(s.service_ms)
        self.client: Optional[Client] = None
        self.killed_counts: Dict[str, Dict[str, int]] = {}

    # -- set-up --

    def start(self) -> None:
        self.s.check_ports()
        total = models.write_node(self.s.catalog.parent, self.s.catalog_models)
        print(f"catalog: {len(self.s.catalog_models)} models, {total / 1e6:.1f} MB "
              f"of weights; each node {self.s.capacity}, loads at "
              f"{self.s.bandwidth} + {self.s.latency} through one slot, "
              f"service {self.s.service_ms} ms", flush=True)
        for n in self.nodes:
            n.start()
        for n in self.nodes:
            n.wait_ready()
        self.prometheus.start()
        self.measure_sizes()

    def measure_sizes(self) -> None:
        """The bytes each model takes in a node's budget (replay's
        size_bytes), as the daemon computes them: `modelcache serve
        --check-catalog --json`."""
        out = subprocess.run(
            [str(self.s.modelcache), "serve", "--check-catalog", "--json",
             "--catalog", str(self.s.catalog), "--model-root", str(self.s.model_root)],
            capture_output=True, text=True)
        if out.returncode != 0:
            raise ClusterError(f"modelcache serve --check-catalog: {out.stderr}")
        self.sizes = {m["id"]: m["bytes"] for m in json.loads(out.stdout)["models"]}
        path = self.s.tmp / "sizes.csv"
        with open(path, "w") as f:
            f.write("model,size_bytes\n")
            for m, b in self.sizes.items():
                f.write(f"{m},{b}\n")

    # -- bookkeeping --

    def check(self, run: str, what: str, ok: bool, detail: str) -> None:
        self.checks.append({"run": run, "check": what, "ok": ok, "detail": detail})
        print(f"  [{'ok' if ok else 'FAIL'}] {what}: {detail}", flush=True)
        if not ok:
            self.failures.append(f"{run}: {what}: {detail}")

    def model_loads(self) -> Dict[str, Dict[str, int]]:
        """node -> model -> loads so far (the daemons' own counts)."""
        return {n.name: {m: v["loads"] for m, v in n.models().items()}
                for n in self.nodes if n.daemon is not None}

    def ring(self, model_file: Path, kill: Optional[str] = None) -> Dict[str, Any]:
        args = [str(self.s.modelcache), "ring", "--nodes", self.s.ring_nodes(),
                "--models", str(model_file)]
        if kill:
            args += ["--kill", kill]
        out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        rows = list(csv.DictReader(out.splitlines()))
        if kill:
            return {r["model"]: (r["from"], r["to"]) for r in rows}
        return {r["model"]: r["node"] for r in rows}

    def predict(self, trace_file: Path, route: str, concurrency: int,
                events: Sequence[str] = ()) -> Tuple[Dict[str, Any], List[str]]:
        args = [str(self.s.modelcache), "replay", str(trace_file),
                "--sizes", str(self.s.tmp / "sizes.csv"),
                "--nodes", self.s.ring_nodes(), "--route", route,
                "--concurrency", str(concurrency), "--capacity", self.s.capacity,
                "--policy", "lru", "--load-bandwidth", self.s.bandwidth,
                "--load-latency", self.s.latency, "--load-slots", "1",
                "--spill-on-full", "--retries", str(self.s.retries),
                "--retry-delay", f"{self.s.timeout_connect_ms}ms",
                "--detect-after", f"{2 * self.s.check_inter_ms}ms", "--json"]
        for e in events:
            args += ["--event", e]
        out = subprocess.run(args, capture_output=True, text=True)
        if out.returncode != 0:
            raise ClusterError(f"{' '.join(args)}: {out.stderr}")
        return json.loads(out.stdout)["results"][0], args

    # -- one run --

    def prepare(self, name: str, route: str, count: int, concurrency: int) -> None:
        """Cold caches and HAProxy on `route` (main thread: it starts HAProxy)."""
        print(f"{name}: {route}, {count} requests, concurrency {concurrency}",
              flush=True)
        for n in self.nodes:
            n.unload_all()
        self.haproxy.start(route)

    def send(self, name: str, route: str, trace: Sequence[Tuple[float, str]],
             concurrency: int, on_sent: Callable[[int], None] = lambda i: None
             ) -> Dict[str, Any]:
        """The trace through HAProxy; the measurement and every request."""
        before = self.model_loads()
        client = self.client = Client(*self.s.frontend(), concurrency)
        started = time.monotonic()
        with BudgetSampler(self.nodes) as sampler:
            requests = client.run(trace, on_sent)
        seconds = time.monotonic() - started
        after = self.model_loads()
        # A node killed during the run: its loads up to the kill (read just
        # before it), then its new daemon's, which count from zero.
        node_loads: Dict[str, int] = {}
        copies: Dict[str, int] = {}
        for n in after:
            gone = self.killed_counts.pop(n, None)
            added = {m: v - before.get(n, {}).get(m, 0) for m, v in after[n].items()}
            if gone is not None:
                added = {m: gone.get(m, 0) - before.get(n, {}).get(m, 0) + v
                         for m, v in after[n].items()}
            node_loads[n] = sum(added.values())
            for m, v in added.items():
                if v > 0:
                    copies[m] = copies.get(m, 0) + 1
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / f"{name}-requests.csv", "w") as f:
            f.write("i,model,status,node,load,wait_ms,sent_ms,done_ms,error\n")
            for r in requests:
                f.write(f"{r.i},{r.model},{r.status},{r.node},{r.load},{r.wait_ms:.3f},"
                        f"{r.sent * 1000:.3f},{r.done * 1000:.3f},{r.error!r}\n")
        ok = [r for r in requests if r.status == 200]
        by_node: Dict[str, int] = {}
        for r in ok:
            by_node[r.node] = by_node.get(r.node, 0) + 1
        measured = {
            "route": route, "concurrency": concurrency, "requests": len(requests),
            "seconds": seconds, "ok": len(ok),
            "errors": [f"#{r.i} {r.model}: {r.status or r.error}"
                       for r in requests if r.status != 200][:20],
            "error_count": sum(1 for r in requests if r.status != 200),
            "loads": sum(node_loads.values()), "node_loads": node_loads,
            "misses_seen": sum(1 for r in ok if r.load == "miss"),
            "request_share": {n.name: by_node.get(n.name, 0) / max(1, len(ok))
                              for n in self.nodes},
            "requests_by_node": by_node,
            "wait_ms": {q: percentile([r.wait_ms for r in ok], p)
                        for q, p in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99),
                                     ("max", 1.0))},
            "copies": copies,
            "budget_max_used": sampler.max_used, "budget_capacity": sampler.capacity,
            "budget_samples": sampler.samples,
        }
        return {"measured": measured, "requests": requests, "sampler": sampler}

    def run(self, name: str, route: str, trace: Sequence[Tuple[float, str]],
            concurrency: int) -> Dict[str, Any]:
        self.prepare(name, route, len(trace), concurrency)
        result = self.send(name, route, trace, concurrency)
        self.check_budget(name, result["sampler"])
        self.check_prometheus(name, result["measured"])
        return result

    def check_budget(self, name: str, sampler: BudgetSampler) -> None:
        over = {n: u for n, u in sampler.max_used.items()
                if n in sampler.capacity and u > sampler.capacity[n]}
        high = {n.name: n.budget()["high_water_bytes"] for n in self.nodes}
        cap = {n.name: n.budget()["capacity_bytes"] for n in self.nodes}
        over_high = {n: h for n, h in high.items() if h > cap[n]}
        self.check(name, "budget (/v1/budget sampled, high water)",
                   not over and not over_high and sampler.samples > 0,
                   f"{sampler.samples} samples; most in use "
                   + ", ".join(f"{n} {u / 1e6:.1f}" for n, u in sampler.max_used.items())
                   + f" MB of {max(cap.values()) / 1e6:.1f}; high water "
                   + ", ".join(f"{n} {h / 1e6:.1f}" for n, h in high.items()))

    def check_prometheus(self, name: str, measured: Dict[str, Any]) -> None:
        """Prometheus' sum of the daemons' loads_total equals theirs, and
        HAProxy's per-server 2xx responses equal the X-Node counts (a 503
        retried on another server is not one)."""
        own = sum(n.loads_metric() for n in self.nodes if n.daemon is not None)
        mark = time.time()
        live = sum(1 for n in self.nodes if n.daemon is not None)
        self.prometheus.wait_scraped_since(mark, {"modelcache": live, "haproxy": 1})
        rows = self.prometheus.query("sum(modelcache_loads_total)")
        queried = float(rows[0]["value"][1]) if rows else math.nan
        self.check(name, "Prometheus agrees (loads)", queried == own,
                   f"sum(modelcache_loads_total) {queried:.0f}, the daemons' own {own:.0f}")
        rows = self.prometheus.query(
            'sum by (server) (haproxy_server_http_responses_total{proxy="nodes",code="2xx"})')
        served = {r["metric"]["server"]: int(float(r["value"][1])) for r in rows}
        seen = {n.name: measured["requests_by_node"].get(n.name, 0) for n in self.nodes}
        served = {n.name: served.get(n.name, 0) for n in self.nodes}
        measured["haproxy_responses"] = served
        if measured["error_count"] == 0:
            self.check(name, "Prometheus agrees (HAProxy's responses per node)",
                       served == seen, f"HAProxy {served}, X-Node {seen}")

    # -- the scenarios --

    def golden(self, count: int, seed: int) -> Dict[str, Any]:
        trace = zipf_trace(list(self.s.catalog_models), count, self.s.zipf, 0, seed)
        trace_file = self.s.tmp / "golden.csv"
        write_trace(trace_file, trace, self.hold_ms)
        owners = self.ring(trace_file)
        result = self.run("golden", "chash", trace, 1)
        requests = result["requests"]
        wrong = [f"#{r.i} {r.model}: {r.node}, ring {owners.get(r.model)}"
                 for r in requests if r.node != owners.get(r.model)]
        self.check("golden", "the ring is HAProxy's (X-Node = modelcache ring)",
                   not wrong and len(requests) == count,
                   f"{count - len(wrong)}/{count} responses from the ring's owner"
                   + (f"; first: {wrong[:3]}" if wrong else ""))
        # The time a request holds its node beyond its wait: the hits'.
        held = [(r.done - r.sent) * 1000 - r.wait_ms for r in requests
                if r.status == 200 and r.load == "hit"]
        if held:
            self.hold_ms = percentile(held, 0.5)
        print(f"  a request holds its node {self.hold_ms:.1f} ms beyond its wait "
              f"(median of {len(held)} hits; SERVICE_MS {self.s.service_ms})", flush=True)
        result["measured"]["hold_ms"] = self.hold_ms
        self.save("golden", result["measured"], None, [])
        return result["measured"]

    def route_run(self, route: str, trace: Sequence[Tuple[float, str]],
                  concurrency: int, tag: str) -> Dict[str, Any]:
        trace_file = self.s.tmp / f"{tag}.csv"
        write_trace(trace_file, trace, self.hold_ms)
        predicted, command = self.predict(trace_file, route, concurrency)
        result = self.run(tag, route, trace, concurrency)
        m = result["measured"]
        m["hottest_model"] = predicted["copies"]["hottest"]["model"]
        m["median_model"] = predicted["copies"]["median"]["model"]
        m["copies_hottest"] = m["copies"].get(m["hottest_model"], 0)
        m["copies_median"] = m["copies"].get(m["median_model"], 0)
        m["copies_mean"] = (sum(m["copies"].values())
                            / max(1, len({mm for _, mm in trace})))
        self.check(tag, "no request failed", m["error_count"] == 0,
                   f"{m['error_count']} errors {m['errors'][:3]}")
        self.save(tag, m, predicted, command)
        return {"measured": m, "predicted": predicted}

    def kill_run(self, route: str, count: int, rate: float, seed: int,
                 victim: str) -> Dict[str, Any]:
        """`route` at concurrency 1 with `victim` SIGKILLed (daemon and
        worker) just before 40% of the trace is sent and started again, cold,
        before 70%: the client waits at those two requests while the main
        thread kills the node, and again until HAProxy has it UP."""
        tag = "kill"
        trace = zipf_trace(list(self.s.catalog_models), count, self.s.zipf, rate, seed)
        trace_file = self.s.tmp / f"{tag}.csv"
        write_trace(trace_file, trace, self.hold_ms)
        owners = self.ring(trace_file)
        moved = self.ring(trace_file, kill=victim)
        node = next(n for n in self.nodes if n.name == victim)
        kill_at, join_at = int(0.4 * count), int(0.7 * count)
        cond = threading.Condition()
        phase = [0]  # 1: at kill_at, 2: killed, 3: at join_at, 4: back
        marks: Dict[str, float] = {}

        def on_sent(i: int) -> None:
            # At kill_at the main thread kills the node while requests go
            # on (those sent before HAProxy marks it DOWN are refused and
            # redispatched); join_at waits until the node is back and UP.
            if i not in (kill_at, join_at):
                return
            with cond:
                phase[0] += 1
                cond.notify_all()
                if i == join_at and not cond.wait_for(lambda: phase[0] >= 4,
                                                      timeout=300):
                    raise ClusterError(f"{tag}: the node was not started again")

        box: Dict[str, Any] = {}

        def drive() -> None:
            try:
                box["result"] = self.send(tag, route, trace, 1, on_sent)
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                box["error"] = e
                with cond:
                    phase[0] = 99
                    cond.notify_all()

        self.prepare(tag, route, count, 1)
        driver = threading.Thread(target=drive, name="kill-run")
        driver.start()
        try:
            for at, act in ((1, "kill"), (3, "start")):
                with cond:
                    cond.wait_for(lambda: phase[0] >= at, timeout=600)
                    if phase[0] == 99:
                        break
                if act == "kill":
                    # Its loads so far (one still running at the kill never
                    # completes, counts nowhere, and its request is retried).
                    self.killed_counts[victim] = self.model_loads()[victim]
                    node.kill()
                    killed = time.monotonic()
                    wait_for(f"haproxy: {victim} DOWN",
                             lambda: not self.haproxy.server_up(victim), timeout=60,
                             period=0.01)
                    marks["down"] = time.monotonic() - self.client.started_at
                    print(f"  {victim} SIGKILLed at request {kill_at}; HAProxy marked "
                          f"it DOWN {1000 * (time.monotonic() - killed):.0f} ms later",
                          flush=True)
                else:
                    node.start()
                    node.wait_ready()
                    wait_for(f"haproxy: {victim} UP again",
                             lambda: self.haproxy.server_up(victim), timeout=60)
                    print(f"  {victim} started again, cold, and UP before request "
                          f"{join_at}", flush=True)
                with cond:
                    phase[0] = at + 1
                    cond.notify_all()
        finally:
            driver.join()
        if "error" in box:
            raise box["error"]
        result = box["result"]
        m, requests = result["measured"], result["requests"]
        self.check_budget(tag, result["sampler"])
        self.check_prometheus(tag, m)
        self.check(tag, "no request failed (retries, redispatch)", m["error_count"] == 0,
                   f"{m['error_count']} errors of {count} {m['errors'][:3]}")
        window = requests[kill_at:join_at]

        def expected(model: str) -> str:
            return moved[model][1] if model in moved else owners[model]

        # Once HAProxy has marked the node DOWN, every request goes where
        # ring --kill says; before, a request sent to the dead node is
        # refused and redispatched to its clockwise successor on the ring.
        astray = [f"#{r.i} {r.model}: {r.node}, expected {expected(r.model)}"
                  for r in window if r.status == 200 and r.sent > marks["down"]
                  and r.node != expected(r.model)]
        redispatched = sum(1 for r in window if r.sent <= marks["down"]
                           and r.model in moved)
        loaded_elsewhere = {r.model for r in window
                            if r.status == 200 and r.load == "miss"
                            and r.node != owners[r.model]}
        moved_requested = {mm for mm in moved if mm in {r.model for r in window}}
        self.check(tag, "a death moves one node's models",
                   loaded_elsewhere == moved_requested and not astray,
                   f"loaded away from their owner while {victim} was dead: "
                   f"{sorted(loaded_elsewhere)}; ring --kill {victim} moves "
                   f"{sorted(moved)} ({len(moved_requested)} of them requested then); "
                   f"after DOWN every request went to ring --kill's node"
                   + (f" but {astray[:3]}" if astray else "")
                   + f"; {redispatched} sent to the dead node before DOWN")
        m["moved"] = sorted(moved)
        m["loaded_elsewhere"] = sorted(loaded_elsewhere)
        # Replay of the run as it was sent (the client waited at join_at
        # while the node started), the node's death and return where they
        # happened.
        sent_file = self.s.tmp / f"{tag}-as-sent.csv"
        write_trace(sent_file, [(r.sent * 1000, r.model) for r in requests], self.hold_ms)
        t0 = requests[0].sent * 1000
        t_kill = requests[kill_at].sent * 1000 - t0
        t_join = requests[join_at].sent * 1000 - t0
        predicted, command = self.predict(
            sent_file, route, 1,
            [f"kill:{victim}@{t_kill:.0f}ms", f"join:{victim}@{t_join:.0f}ms"])
        m["kill_ms"], m["join_ms"] = t_kill, t_join
        self.save(tag, m, predicted, command)
        return {"measured": m, "predicted": predicted}

    def save(self, tag: str, measured: Dict[str, Any],
             predicted: Optional[Dict[str, Any]], command: List[str]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"run": tag, "measured": measured, "predicted": predicted,
                  "replay_command": " ".join(command),
                  "checks": [c for c in self.checks if c["run"] == tag]}
        (self.out / f"{tag}.json").write_text(json.dumps(record, indent=1, default=str))


def compare(c: Cluster, tag: str, r: Dict[str, Any]) -> None:
    """replay's prediction against the measurement, within the bounds."""
    m, p = r["measured"], r["predicted"]
    loads_ok = abs(m["loads"] - p["loads"]) <= 0.10 * p["loads"]
    c.check(tag, "replay predicts total loads (±10%)", loads_ok,
            f"measured {m['loads']}, predicted {p['loads']}")
    shares = {n["name"]: n["request_share"] for n in p["nodes"]}
    worst = max(abs(m["request_share"][n] - shares[n]) for n in shares)
    c.check(tag, "replay predicts each node's request share (±3 points)",
            worst <= 0.03,
            ", ".join(f"{n} {100 * m['request_share'][n]:.1f}% vs {100 * shares[n]:.1f}%"
                      for n in shares))
    p99, pp99 = m["wait_ms"]["p99"], p["wait_ms"]["p99"]
    c.check(tag, "replay predicts p99 wait (±25%)", abs(p99 - pp99) <= 0.25 * pp99,
            f"measured {p99:.1f} ms, predicted {pp99:.1f} ms")


def summary(c: Cluster, results: Dict[str, Dict[str, Any]]) -> str:
    lines = ["| route | loads (measured / replay) | p99 wait ms (measured / replay) "
             "| copies hottest / median (measured / replay) "
             "| request share per node, measured (replay) | s |",
             "|---|---|---|---|---|---|"]
    for tag, r in results.items():
        m, p = r["measured"], r.get("predicted")
        if p is None or "copies_hottest" not in m:
            continue
        shares = {n["name"]: n["request_share"] for n in p["nodes"]}
        lines.append(
            f"| {m['route']} | {m['loads']} / {p['loads']} | "
            f"{m['wait_ms']['p99']:.0f} / {p['wait_ms']['p99']:.0f} | "
            f"{m['copies_hottest']}/{m['copies_median']} / "
            f"{p['copies']['hottest']['copies']}/{p['copies']['median']['copies']} | "
            + " ".join(f"{100 * m['request_share'][n]:.0f} ({100 * shares[n]:.0f})"
                       for n in sorted(shares))
            + f" | {m['seconds']:.0f} |")
    kill = results.get("kill")
    if kill:
        m, p = kill["measured"], kill["predicted"]
        lines.append("")
        lines.append(f"kill ({m['route']}, concurrency 1, one node SIGKILLed at 40% and "
                     f"started again cold at 70%): {m['loads']} loads (replay "
                     f"{p['loads']}), p99 wait {m['wait_ms']['p99']:.0f} ms (replay "
                     f"{p['wait_ms']['p99']:.0f}), {m['error_count']} errors, "
                     f"{len(m['loaded_elsewhere'])} models loaded away from their "
                     f"owner, all in ring --kill's moved set of {len(m['moved'])}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="the short version in `make test`: fewer requests, "
                         "routes roundrobin, chash and chash-bl only")
    ap.add_argument("--build", default=str(REPO / "build"))
    ap.add_argument("--out", default=None, help="results (default BUILD/cluster-results)")
    ap.add_argument("--base-port", type=int, default=0,
                    help="P: workers on 127.0.0.2-5:P, daemons on P+1, HAProxy "
                         "P+2 (its exporter P+3), Prometheus P+4 (default: free ones)")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--models", type=int, default=64)
    ap.add_argument("--zipf", type=float, default=1.2,
                    help="the traces' popularity exponent")
    ap.add_argument("--requests", type=int, default=0,
                    help="per route run (default 2000, --quick 800)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--balance-factor", type=int, default=300,
                    help="chash-bl's hash-balance-factor")
    ap.add_argument("--capacity", default="24MB", help="each node's host budget")
    ap.add_argument("--load-bandwidth", default="50MB/s")
    ap.add_argument("--load-latency", default="20ms")
    ap.add_argument("--service-ms", type=float, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)
    # The catalog's models are written with the package's safetensors writer
    # (models.write_node), from this build.
    sys.path.insert(0, str(Path(args.build) / "python"))
    if not 1 <= args.nodes <= 250:
        ap.error("--nodes: 1 to 250")
    count = args.requests or (800 if args.quick else 2000)
    out = Path(args.out) if args.out else Path(args.build) / "cluster-results"
    for tool in ("haproxy", "prometheus"):
        if not shutil.which(tool):
            print(f"skipped: {tool} not found (scripts/install-deps.sh installs it)",
                  file=sys.stderr)
            return 77
    if args.base_port == 0:
        args.base_port = pick_base_port(args.nodes)
    tmp = Path(tempfile.mkdtemp(prefix="modelcache-cluster-"))
    logs = tmp / "logs"
    logs.mkdir()
    procs = Processes(logs)
    atexit.register(procs.stop_all)

    def on_signal(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    s = Settings(args, tmp)
    cluster = Cluster(s, procs, out)
    results: Dict[str, Dict[str, Any]] = {}
    status = 1
    try:
        cluster.start()
        cluster.golden(200 if args.quick else 400, args.seed)
        routes = (["roundrobin", "chash", f"chash-bl:{args.balance_factor}"] if args.quick
                  else ["roundrobin", "leastconn", "random", "p2c", "chash",
                        f"chash-bl:{args.balance_factor}", "chash-map"])
        trace = zipf_trace(list(s.catalog_models), count, args.zipf, 0, args.seed + 1)
        for route in routes:
            results[route] = cluster.route_run(route, trace, args.concurrency, route)
        rr, ch = results["roundrobin"]["measured"], results["chash"]["measured"]
        cluster.check("chash", "affinity pays (chash loads ≤ 0.5 × roundrobin's)",
                      ch["loads"] <= 0.5 * rr["loads"],
                      f"chash {ch['loads']}, roundrobin {rr['loads']}")
        bl = f"chash-bl:{args.balance_factor}"
        compare(cluster, bl, results[bl])
        m = results[bl]["measured"]
        cluster.check(bl, "a hot model spreads, a cold one does not",
                      m["copies_hottest"] >= 2 and m["copies_median"] == 1,
                      f"hottest {m['hottest_model']} on {m['copies_hottest']} nodes, "
                      f"median {m['median_model']} on {m['copies_median']}")
        results["kill"] = cluster.kill_run(
            bl, 400 if args.quick else 800, 25.0, args.seed + 2, s.name(2))
        # Prometheus over the whole session: no node over its capacity.
        rows = cluster.prometheus.query(
            "max_over_time(modelcache_budget_used_bytes[1h]) "
            "- on(instance) modelcache_budget_capacity_bytes")
        worst = max((float(r["value"][1]) for r in rows), default=math.nan)
        cluster.check("all", "budget (Prometheus max_over_time)",
                      bool(rows) and worst <= 0,
                      f"{len(rows)} series; most in use minus capacity {worst / 1e6:+.1f} MB")
        table = summary(cluster, results)
        print("\n" + table)
        (out / "summary.md").write_text(table + "\n")
        (out / "summary.json").write_text(json.dumps(
            {"checks": cluster.checks, "failures": cluster.failures,
             "settings": {k: v for k, v in vars(args).items()}}, indent=1))
        status = 0 if not cluster.failures else 1
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        status = 1
    finally:
        cluster.haproxy.stop()
        procs.stop_all()
        left = procs.running()
        if left:
            print(f"error: processes left behind: {left}", file=sys.stderr)
            status = 1
        if args.keep or status != 0:
            print(f"logs: {logs}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if cluster.failures:
        print("\nFAILED:\n" + "\n".join(cluster.failures), file=sys.stderr)
    return status


def pick_base_port(nodes: int) -> int:
    """A P with P..P+4 free on every address the cluster uses."""
    rng = random.Random(os.getpid())
    for _ in range(200):
        p = rng.randrange(20000, 60000)
        hosts = [f"127.0.0.{k + 1}" for k in range(1, nodes + 1)]
        if all(port_free(h, p) and port_free(h, p + 1) for h in hosts) and \
                all(port_free("127.0.0.1", p + d) for d in (2, 3, 4)):
            return p
    raise ClusterError("no free ports found")


if __name__ == "__main__":
    sys.exit(main())
