"""The multi-worker example (examples/python/node_server/) as a user runs it:
`modelcache serve`, and the FastAPI app under uvicorn --workers 4 (or
gunicorn with uvicorn workers, whose arbiter restarts a killed worker).

Every process is started here and stopped by pid (the server's workers too),
even when a test fails; HTTP runs over UNIX sockets only. Request counts are
fixed. Answers are compared with the model run directly on weights the test
computes itself (models.weights, not the daemon's copy).
"""

from __future__ import annotations

import concurrent.futures
import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from serve_util import (  # noqa: E402
    Daemon, UnixHTTPConnection, build_dir, die_with_parent, memfd_maps,
    stop_process, wait_until)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples/python/node_server"
sys.path.insert(0, str(EXAMPLE))
import models  # noqa: E402

WORKERS = 4
CLIENTS = 8
REQUESTS_PER_CLIENT = 20
BATCH = 3


def request(path: str, method: str, url: str, body: Any = None
            ) -> Tuple[int, Any, Any]:
    """(status, headers (case-insensitive), body)."""
    conn = UnixHTTPConnection(path)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, url, body=data,
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        payload = r.read()
        return r.status, r.msg, json.loads(payload)
    finally:
        conn.close()


def inputs_for(model_id: str, seed: int) -> List[List[float]]:
    g = torch.Generator().manual_seed(seed)
    d_in = models.SHAPES[model_id][0]
    return torch.randn(BATCH, d_in, generator=g).tolist()


def expected(model_id: str, inputs: List[List[float]]) -> torch.Tensor:
    """The model run directly, on weights made here (not read back)."""
    tensors = {k: torch.from_numpy(v) for k, v in models.weights(model_id).items()}
    return torch.tensor(models.run(models.bind(model_id, tensors), inputs))


def shmem_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


def children(pid: int) -> List[int]:
    out: List[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            out += [int(p) for p in text.split()]
    except FileNotFoundError:
        pass
    return out


class Server:
    """The example under uvicorn (or gunicorn); stop() ends the server and
    every worker it started, by pid."""

    def __init__(self, tmp: Path, daemon: Daemon, runner: str = "uvicorn",
                 env: Optional[Dict[str, str]] = None,
                 workers: Optional[int] = None,
                 app_dir: Optional[Path] = None) -> None:
        # app_dir: another copy of the example (the benchmark's baseline).
        app_dir = app_dir or EXAMPLE
        self.count = workers or WORKERS
        self.runner = runner
        self.uds = str(tmp / "http.sock")
        self.log = tmp / f"{runner}.log"
        environment = dict(os.environ)
        environment.update({
            "PYTHONPATH": os.pathsep.join([str(build_dir() / "python"), str(app_dir)]),
            "MODELCACHE_SOCKET": daemon.socket,
            "NODE_NAME": "test-node",
        })
        environment.update(env or {})
        if runner == "uvicorn":
            args = [sys.executable, "-m", "uvicorn", "app:app", "--workers",
                    str(self.count), "--uds", self.uds, "--log-level", "warning"]
        else:
            args = [sys.executable, "-m", "gunicorn", "app:app", "-k",
                    "uvicorn.workers.UvicornWorker", "-w", str(self.count),
                    "--bind", "unix:" + self.uds, "--log-level", "warning",
                    "--graceful-timeout", "5"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, env=environment, cwd=str(app_dir),
                                         stdout=log, stderr=log,
                                         preexec_fn=die_with_parent)
        self.seen: set = set()
        try:
            wait_until(self._answers, "the server answers /healthz", bound=120,
                       step=0.05)
            wait_until(lambda: len(self.workers()) == self.count,
                       f"{self.count} workers run", bound=120, step=0.05)
        except BaseException:
            self.stop()
            raise

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError("the server exited: " + self.log.read_text())
        try:
            return request(self.uds, "GET", "/healthz")[0] == 200
        except OSError:
            return False

    def workers(self) -> List[int]:
        """The server's worker processes (not multiprocessing's resource
        tracker, which uvicorn's spawned workers bring along)."""
        if self.count == 1 and self.runner == "uvicorn":
            return [self.proc.pid]  # it runs the app itself
        pids = children(self.proc.pid)
        self.seen.update(pids)
        workers = []
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except FileNotFoundError:
                continue
            if b"resource_tracker" not in cmdline:
                workers.append(pid)
        return workers

    def stop(self) -> None:
        self.workers()
        stop_process(self.proc)
        for pid in self.seen:  # any worker its server left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def node(tmp_path):
    total = models.write_node(tmp_path)
    started: List[Any] = []

    def daemon(capacity: str = "512MiB", **kw) -> Daemon:
        d = Daemon(tmp_path, tmp_path / "catalog.json", tmp_path / "models",
                   capacity=capacity, **kw).start()
        started.append(d)
        return d

    def server(d: Daemon, **kw) -> Server:
        s = Server(tmp_path, d, **kw)
        started.insert(0, s)  # stopped before the daemon
        return s

    daemon.total = total
    daemon.server = server
    yield daemon
    for p in started:
        p.stop()


def drive(uds: str, clients: int, per_client: int, seed: int = 0
          ) -> List[Tuple[str, int, Dict[str, str], Any, List[List[float]]]]:
    """`clients` threads each send `per_client` requests over the models;
    returns (model, status, headers, body, inputs), or (model, -1, {}, error,
    inputs) for a request that got no answer."""
    ids = list(models.SHAPES)

    def one_client(c: int):
        out = []
        for i in range(per_client):
            model_id = ids[(c + i) % len(ids)]
            inputs = inputs_for(model_id, seed * 100000 + c * 1000 + i)
            try:
                status, headers, body = request(
                    uds, "POST", f"/v1/models/{model_id}/infer", {"inputs": inputs})
                out.append((model_id, status, headers, body, inputs))
            except OSError as e:
                out.append((model_id, -1, {}, repr(e), inputs))
        return out

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one_client, range(clients)))
    return [r for rs in results for r in rs]


def check_answer(model_id, status, headers, body, inputs) -> None:
    assert status == 200, (model_id, status, body)
    assert headers["X-Node"] == "test-node"
    assert headers["X-Load"] in ("local", "hit", "miss", "joined")
    assert float(headers["X-Wait-Ms"]) >= 0
    torch.testing.assert_close(torch.tensor(body["outputs"]),
                               expected(model_id, inputs), rtol=1e-5, atol=1e-5)


def books_match_maps(daemon: Daemon, pids: List[int]) -> None:
    """The daemon's books equal what the processes map: every modelcache
    memfd a process maps is a copy the daemon holds, or a previous daemon's
    copy it books as orphaned by that pid; every orphan's pid maps it; every
    lease's pid maps its model."""
    copies = daemon.get("/v1/copies")
    live = {c["inode"] for c in copies["memfds"]}
    orphans = {o["inode"]: set(o["pids"]) for o in copies["orphans"]}
    for pid in pids:
        for line in memfd_maps(pid):
            inode = int(line.split()[4])
            assert inode in live or pid in orphans.get(inode, ()), (pid, line, copies)
    for inode, holders in orphans.items():
        for pid in holders:
            assert any(int(l.split()[4]) == inode for l in memfd_maps(pid)), (pid, inode)
    for m in models.SHAPES:
        for lease in daemon.leases(m):
            assert memfd_maps(lease["pid"], f":{m}#"), (m, lease)


def uses(daemon: Daemon, model: str) -> List[Tuple[int, str]]:
    """(pid, use) of every lease the daemon holds on `model`."""
    return [(l["pid"], l["use"]) for l in daemon.leases(model)]


def metric(daemon: Daemon, sample: str) -> float:
    for line in daemon.get("/metrics").splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no sample {sample} in /metrics")


def test_four_workers_hold_one_copy(node):
    shmem_before = shmem_bytes()
    daemon = node()
    # Idle leases kept longer than the test runs, however slow the machine.
    server = node.server(daemon, env={"MODELCACHE_KEEP_IDLE": "600"})
    results = drive(server.uds, CLIENTS, REQUESTS_PER_CLIENT)
    assert len(results) == CLIENTS * REQUESTS_PER_CLIENT
    for r in results:
        check_answer(*r)
    pids = {r[2]["X-Worker-Pid"] for r in results}
    assert len(pids) > 1, "the requests reached one worker only"
    # Each model loaded once, held once, whoever asked.
    loads = {m: daemon.model(m)["loads"] for m in models.SHAPES}
    assert loads == {m: 1 for m in models.SHAPES}
    # One request per model loaded it; the others found it or joined it.
    misses = [r[0] for r in results if r[2]["X-Load"] == "miss"]
    assert sorted(misses) == sorted(models.SHAPES), misses
    grew = shmem_bytes() - shmem_before
    # The machine is shared: another process may move Shmem a little, but
    # four copies would be 4x.
    assert 0.8 * node.total < grew < 2 * node.total, (grew, node.total)
    # Workers that hold a model map the daemon's one memfd of it.
    inodes = {}
    for pid in server.workers():
        for line in memfd_maps(pid):
            name = line.split("/memfd:")[1].split()[0]
            inodes.setdefault(name, set()).add(line.split()[4])
    assert inodes and all(len(v) == 1 for v in inodes.values()), inodes
    books_match_maps(daemon, server.workers())
    # No request runs now: every lease is idle, which the daemon counts as
    # evictable (the budget is honest), none is in use, and a worker holds
    # one lease per model (the daemon sees one lease per process per copy).
    wait_until(lambda: all(u == "idle" for m in models.SHAPES
                           for _, u in uses(daemon, m)),
               "every worker's leases are idle")
    assert metric(daemon, 'modelcache_delegated_leases{use="in_use"}') == 0
    assert metric(daemon, 'modelcache_delegated_leases{use="idle"}') > 0
    for m in models.SHAPES:
        pids = [pid for pid, _ in uses(daemon, m)]
        assert len(pids) == len(set(pids)), (m, pids)
    # Each request acquires and releases; a request of a model its worker
    # served before finds the idle lease there: local, no round trip.
    served = {(r[2]["X-Worker-Pid"], r[0]) for r in results}
    checked = 0
    for r in drive(server.uds, 1, 2 * len(models.SHAPES), seed=1):
        check_answer(*r)
        if (r[2]["X-Worker-Pid"], r[0]) in served:
            assert r[2]["X-Load"] == "local", r[2]["X-Load"]
            checked += 1
    assert checked > 0
    assert {m: daemon.model(m)["loads"] for m in models.SHAPES} == loads


def test_a_killed_worker_frees_its_leases_and_the_others_answer(node):
    daemon = node()
    server = node.server(daemon, runner="gunicorn")
    for r in drive(server.uds, CLIENTS, 5):
        check_answer(*r)
    victim = next(l["pid"] for m in models.SHAPES for l in daemon.leases(m))
    assert victim in server.workers()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        load = pool.submit(drive, server.uds, CLIENTS, REQUESTS_PER_CLIENT, 1)
        os.kill(victim, signal.SIGKILL)
        results = load.result(timeout=300)
    # Its leases end with it; the arbiter starts a replacement.
    wait_until(lambda: all(l["pid"] != victim for m in models.SHAPES
                           for l in daemon.leases(m)),
               "the daemon frees the killed worker's leases")
    wait_until(lambda: len(server.workers()) == WORKERS and victim not in server.workers(),
               "a replacement worker runs", bound=120)
    # Only requests the killed worker had accepted may go unanswered (a
    # connection reset); every answer is right and no answer is an error.
    lost = [r for r in results if r[1] == -1]
    assert len(lost) <= CLIENTS, lost
    for r in results:
        if r[1] != -1:
            check_answer(*r)
    for r in drive(server.uds, CLIENTS, 5, seed=2):
        check_answer(*r)
    books_match_maps(daemon, server.workers())


def test_daemon_killed_under_load_fails_no_request_for_a_mapped_model(node):
    daemon = node()
    server = node.server(daemon)
    sent = [0]

    def every_worker_holds_a_lease() -> bool:
        # Requests until each worker has connected and holds idle leases (a
        # worker that never connected would back off after the kill, and
        # answer 503 for a while after the restart too).
        for model_id in ["m0", "m1", "m2", "m3"]:
            inputs = inputs_for(model_id, sent[0])
            sent[0] += 1
            check_answer(model_id, *request(server.uds, "POST",
                                            f"/v1/models/{model_id}/infer",
                                            {"inputs": inputs}), inputs)
        holders = {l["pid"] for m in models.SHAPES for l in daemon.leases(m)}
        return holders >= set(server.workers())

    wait_until(every_worker_holds_a_lease, "every worker holds a lease",
               bound=120)
    # What each worker maps now. Nothing is recalled (the budget holds every
    # model), so each still maps these when the daemon dies.
    mapped = {(l["pid"], m) for m in models.SHAPES for l in daemon.leases(m)}

    def check(results, what: str) -> int:
        """Every request for a model its worker mapped is answered from the
        mapping; any other is a 503 at once. Returns how many were served."""
        served = 0
        for model_id, status, headers, body, inputs in results:
            assert status in (200, 503), (what, model_id, status, body)
            pid = int(headers["X-Worker-Pid"])
            if status == 503:
                assert (pid, model_id) not in mapped, (what, model_id, pid, body)
                assert headers["Retry-After"] == "1" and body["error"] == "UNAVAILABLE", body
            else:
                check_answer(model_id, status, headers, body, inputs)
                served += 1
        return served

    # Killed under load: requests in flight and after.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        during = pool.submit(drive, server.uds, CLIENTS, 10, 5)
        daemon.kill()
        check(during.result(), "while the daemon dies")
    # After: each worker serves the models it maps, for as long as the
    # daemon is away, from the mapping; the others answer 503 at once.
    local = set()
    for i in range(40 * WORKERS):
        pid, model_id = sorted(mapped)[i % len(mapped)]
        inputs = inputs_for(model_id, 7000 + i)
        start = time.monotonic()
        status, headers, body = request(server.uds, "POST",
                                        f"/v1/models/{model_id}/infer",
                                        {"inputs": inputs})
        assert time.monotonic() - start < 10  # not a queue of minutes
        check([(model_id, status, headers, body, inputs)], "daemon down")
        if (int(headers["X-Worker-Pid"]), model_id) in mapped:
            assert status == 200 and headers["X-Load"] == "local", (headers, body)
            local.add(int(headers["X-Worker-Pid"]))
        if local >= set(server.workers()):
            break
    assert local >= set(server.workers()), "every worker served a mapped model"
    # Meanwhile each worker keeps its leases mapped for a successor.
    assert all(memfd_maps(pid) for pid in server.workers())
    restarted = node()
    # Under load at once: the successor adopts each copy a worker maps (its
    # client reclaims it, with no request) before it answers an acquire
    # that would load it again.
    check(drive(server.uds, CLIENTS, 10, seed=3), "after the restart")

    def every_worker_reclaimed() -> bool:
        holders = {l["pid"] for m in models.SHAPES for l in restarted.leases(m)}
        return holders >= set(server.workers())

    wait_until(every_worker_reclaimed, "every worker's leases are reclaimed")
    for r in drive(server.uds, CLIENTS, 10, seed=4):
        check_answer(*r)
    # 0 bytes loaded for what was mapped.
    for m in {m for _, m in mapped}:
        assert restarted.model(m)["loads"] == 0, (m, restarted.model(m))
    # Nothing leaks: the new daemon's books equal what processes map, and
    # no copy of the old daemon is still mapped (nothing orphaned).
    books_match_maps(restarted, server.workers())
    assert restarted.get("/v1/copies")["orphans"] == []


def test_the_module_runs_on_the_shared_mapping(node):
    """models.bind makes the daemon's zero-copy tensors the module's own
    parameters: same addresses, the mapping's, and the model's answers."""
    import modelcache.serve

    daemon = node()
    client = modelcache.serve.connect(daemon.socket)
    with client.acquire("m2") as lease:
        net = models.bind("m2", lease.torch())
        for name, param in net.named_parameters():
            assert param.data_ptr() == lease.numpy(name).ctypes.data, name
            assert not param.requires_grad
        inputs = inputs_for("m2", 5)
        assert torch.equal(torch.tensor(models.run(net, inputs)),
                           expected("m2", inputs))
    del net, param
    gc.collect()
    # The module was the last user: the lease is idle (delegated), still
    # mapped for the next acquire, and evictable for the daemon.
    wait_until(lambda: uses(daemon, "m2") == [(os.getpid(), "idle")],
               "the lease is idle once the module is gone")
    assert client.idle_leases() == 1


def test_a_bound_module_views_the_mapping_only_inside_its_block(node):
    """models.bound (what the server runs per request) runs this thread's
    module on the lease's tensors inside the block, with the model's
    answers; after it the module views nothing of the mapping, so the lease
    goes idle while the module lives on for the next request. Another
    thread gets a module of its own; a nested block of one shape raises."""
    import modelcache.serve

    daemon = node()
    client = modelcache.serve.connect(daemon.socket)
    inputs = inputs_for("m2", 5)
    with client.acquire("m2") as lease:
        tensors = lease.torch()
        with models.bound("m2", tensors) as net:
            for name, param in net.named_parameters():
                assert param.data_ptr() == lease.numpy(name).ctypes.data, name
            assert torch.equal(torch.tensor(models.run(net, inputs)),
                               expected("m2", inputs))
            with pytest.raises(ValueError, match="already bound"):
                with models.bound("m2", tensors):
                    pass
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                other = pool.submit(lambda: _bound_module("m2", tensors)).result()
            assert other is not net
        del tensors, param
    assert all(p.is_meta for p in net.parameters())
    gc.collect()
    wait_until(lambda: uses(daemon, "m2") == [(os.getpid(), "idle")],
               "the lease is idle while the module lives")
    with client.acquire("m2") as lease:
        assert lease.load == "local"
        with models.bound("m2", lease.torch()) as again:
            assert again is net  # built once per thread and shape
            assert torch.equal(torch.tensor(models.run(again, inputs)),
                               expected("m2", inputs))


def _bound_module(model_id: str, tensors: Dict[str, Any]) -> Any:
    with models.bound(model_id, tensors) as net:
        return net


def test_a_full_node_answers_503_at_once_and_recalls_idle_leases(node):
    """TOO_LARGE and CAPACITY (nothing evictable: a lease in use holds the
    other model) are refused at once with 503 and Retry-After, not queued;
    a model the worker holds only idle is recalled to make room."""
    import modelcache.serve

    daemon = node(capacity="30MiB", http="127.0.0.1:0")  # m3 (21 MB) fits, m3 + m2 do not
    server = node.server(daemon, workers=1,
                         env={"DAEMON_HTTP": daemon.ready["http"]})
    worker = server.workers()[0]
    status, _, body = request(server.uds, "GET", "/readyz")
    assert (status, body["ready"], body["node"]) == (200, True, "test-node"), body

    def infer(model_id):
        inputs = inputs_for(model_id, 1)
        return request(server.uds, "POST", f"/v1/models/{model_id}/infer",
                       {"inputs": inputs}), inputs

    (status, headers, body), inputs = infer("m4")  # 42 MB
    assert (status, body["error"], headers["Retry-After"]) == (503, "TOO_LARGE", "1"), body
    # A model the daemon's catalog lacks is 404, not 503: no other node has it.
    status, _, body = request(server.uds, "POST", "/v1/models/m9/infer",
                              {"inputs": inputs_for("m0", 1)})
    assert status == 404 and "m9" in body["detail"], body
    (status, headers, body), inputs = infer("m3")
    check_answer("m3", status, headers, body, inputs)
    assert headers["X-Load"] == "miss"
    wait_until(lambda: uses(daemon, "m3") == [(worker, "idle")],
               "the worker's lease on m3 is idle")
    # This process uses m3 too: nothing is evictable, m2 is refused.
    mine = modelcache.serve.connect(daemon.socket, keep_idle=0).acquire("m3")
    (status, headers, body), _ = infer("m2")
    assert (status, body["error"], headers["Retry-After"]) == (503, "CAPACITY", "1"), body
    assert "m3" in body["message"]  # it names what holds the memory
    assert daemon.model("m2")["loads"] == 0
    mine.release()
    wait_until(lambda: uses(daemon, "m3") == [(worker, "idle")],
               "only the worker's idle lease holds m3")
    # Now m3 is held only idle: the daemon recalls it from the worker, which
    # unmaps it and answers release, and m2 loads.
    (status, headers, body), inputs = infer("m2")
    check_answer("m2", status, headers, body, inputs)
    assert headers["X-Load"] == "miss"
    assert metric(daemon, 'modelcache_recalls_total{answer="release"}') == 1
    assert uses(daemon, "m3") == [] and not memfd_maps(worker, ":m3#")
    (status, headers, body), inputs = infer("m2")
    check_answer("m2", status, headers, body, inputs)
    assert headers["X-Load"] == "local"
    daemon.kill()
    status, headers, body = request(server.uds, "GET", "/readyz")
    assert (status, body["ready"], headers["Retry-After"]) == (503, False, "1"), body


def test_a_cold_worker_answers_503_within_connect_timeout(node):
    """A worker started while the daemon is down answers every request 503
    within CONNECT_TIMEOUT (it never reached the daemon: the connect itself
    is bounded, and after a failure it backs off rather than trying again in
    full on each request), then serves once the daemon is up."""
    daemon = node()
    daemon.kill()  # its socket stays, with nobody behind it
    timeout = 0.3
    server = node.server(daemon, workers=1,
                         env={"CONNECT_TIMEOUT": str(timeout),
                              "CONNECT_BACKOFF_MAX": "0.2"})
    for i in range(8):
        model_id = list(models.SHAPES)[i % 5]
        start = time.monotonic()
        status, headers, body = request(server.uds, "POST",
                                        f"/v1/models/{model_id}/infer",
                                        {"inputs": inputs_for(model_id, i)})
        elapsed = time.monotonic() - start
        assert (status, body["error"], headers["Retry-After"]) == (503, "UNAVAILABLE", "1"), body
        # The worker's own measure of the wait, and the whole round trip.
        assert float(headers["X-Wait-Ms"]) <= timeout * 1000 + 50, (i, headers["X-Wait-Ms"])
        assert elapsed < timeout + 2, (i, elapsed)
    node()  # the daemon is back: the worker connects after its backoff
    inputs = inputs_for("m0", 99)
    wait_until(lambda: request(server.uds, "POST", "/v1/models/m0/infer",
                               {"inputs": inputs})[0] == 200,
               "the cold worker reaches the daemon once it is up", bound=60,
               step=0.05)
    check_answer("m0", *request(server.uds, "POST", "/v1/models/m0/infer",
                                {"inputs": inputs}), inputs)
