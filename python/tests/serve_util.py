"""Helpers for the tests that run `modelcache serve`: models written as
safetensors files, a catalog, and a daemon process that every test stops by
pid (SIGTERM, then SIGKILL), even when it fails. Children get
PR_SET_PDEATHSIG, so a test killed by its timeout takes them with it.

The daemon's HTTP API is read over its admin UNIX socket: nothing listens on
TCP.
"""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from modelcache.weights import save_file

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the test process dies."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def build_dir() -> Path:
    env = os.environ.get("MODELCACHE_BUILD_DIR")
    return Path(env).resolve() if env else Path(__file__).resolve().parents[2] / "build"


def modelcache_binary() -> Path:
    return build_dir() / "bin" / "modelcache"


def write_safetensors(path: Path, tensors: Dict[str, np.ndarray]) -> int:
    """Writes `tensors` with the package's writer; returns the data bytes."""
    save_file(tensors, path)
    return sum(t.nbytes for t in tensors.values())


def random_model(seed: int, rows: int = 64, cols: int = 32) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "weight": rng.standard_normal((rows, cols), dtype=np.float32),
        "bias": rng.standard_normal(rows, dtype=np.float32),
        "steps": np.arange(7, dtype=np.int64) * seed,
    }


def write_catalog(path: Path, models: Sequence[Dict[str, Any]]) -> None:
    path.write_text(json.dumps({"models": list(models)}))


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 over the UNIX socket at `path` (the daemon's admin socket, a
    node server's socket)."""

    def __init__(self, path: str, timeout: float = 60.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def unix_http(path: str, method: str, url: str, body: Optional[bytes] = None,
              timeout: float = 30.0) -> "tuple[int, Any]":
    conn = UnixHTTPConnection(path, timeout)
    try:
        conn.request(method, url, body=body)
        r = conn.getresponse()
        data = r.read()
        try:
            parsed = json.loads(data)
        except ValueError:
            parsed = data.decode(errors="replace")
        return r.status, parsed
    finally:
        conn.close()


def stop_process(proc: subprocess.Popen) -> None:
    """Ends `proc` if it still runs: SIGTERM, then SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


class Daemon:
    """`modelcache serve` in a child process, started and waited for through
    --ready-fd; stop() ends it by pid."""

    def __init__(self, tmp: Path, catalog: Path, root: Path, *,
                 capacity: str = "64MiB", socket_path: Optional[Path] = None,
                 extra: Sequence[str] = (), gate: bool = False,
                 http: str = "off") -> None:
        self.tmp = tmp
        self.catalog = catalog
        self.root = root
        self.capacity = capacity
        self.socket = str(socket_path or tmp / "run" / "serve.sock")
        self.admin = self.socket + ".admin"
        self.extra = list(extra)
        self.gate_w: Optional[int] = None
        self.proc: Optional[subprocess.Popen] = None
        self._gate = gate
        self._http = http
        self.ready: Dict[str, Any] = {}
        self.log = tmp / "daemon.log"

    def start(self) -> "Daemon":
        ready_r, ready_w = os.pipe()
        fds = [ready_w]
        http = self._http
        args = [str(modelcache_binary()), "serve", "--catalog", str(self.catalog),
                "--model-root", str(self.root), "--socket", self.socket,
                "--host-capacity", self.capacity, "--http", http,
                "--ready-grace", "0s", "--orphan-rescan", "100ms",
                "--ready-fd", str(ready_w)] + self.extra
        gate_r = None
        if self._gate:
            gate_r, self.gate_w = os.pipe()
            fds.append(gate_r)
            args += ["--test-load-gate-fd", str(gate_r)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, pass_fds=fds, stdout=log,
                                         stderr=log, preexec_fn=die_with_parent)
        os.close(ready_w)
        if gate_r is not None:
            os.close(gate_r)
        with os.fdopen(ready_r, "rb") as r:
            line = r.readline()
        if not line:
            self.stop()
            raise AssertionError("the daemon did not start: " +
                                 self.log.read_text(errors="replace"))
        self.ready = json.loads(line)  # "http": the bound address, if any
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def open_gate(self, loads: int = 1) -> None:
        """Lets `loads` file reads proceed."""
        assert self.gate_w is not None
        os.write(self.gate_w, b"x" * loads)

    def close_gate(self) -> None:
        """Lets every load proceed from now on."""
        if self.gate_w is not None:
            os.close(self.gate_w)
            self.gate_w = None

    def http(self, method: str, url: str, body: Optional[bytes] = None) -> "tuple[int, Any]":
        return unix_http(self.admin, method, url, body)

    def get(self, url: str) -> Any:
        status, body = self.http("GET", url)
        assert status == 200, (url, status, body)
        return body

    def model(self, model_id: str) -> Dict[str, Any]:
        return self.get("/v1/models/" + model_id)

    def leases(self, model_id: str) -> List[Dict[str, Any]]:
        return self.model(model_id).get("leases", [])

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        self.close_gate()
        if self.proc is None:
            return
        stop_process(self.proc)


def metric(daemon: Daemon, name: str, labels: str = "") -> float:
    """One sample of the daemon's /metrics (`labels` as written there)."""
    text = daemon.get("/metrics")
    sample = name + ("{" + labels + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no sample {sample} in /metrics")


def memfd_maps(pid: int, needle: str = "modelcache") -> List[str]:
    """The memfd mappings of process `pid` whose name contains `needle`."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except (FileNotFoundError, ProcessLookupError):
        return []
    return [l for l in lines if "/memfd:" in l and needle in l]


def wait_until(condition, what: str, bound: float = 60.0, step: float = 0.01) -> None:
    """Polls observable state (a daemon's books, a process's maps); the
    bound only turns a hang into a failure."""
    give_up = time.monotonic() + bound
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError("never: " + what)
        time.sleep(step)
