"""modelcache.serve against a real `modelcache serve` daemon.

Each test starts its own daemon on a UNIX socket in its tmp folder and stops
it by pid. What the daemon holds is read from its HTTP API (over the admin
UNIX socket) and from /proc/<pid>/maps, never inferred from timing.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import modelcache
import modelcache.serve
from modelcache import errors

from serve_util import (
    Daemon,
    die_with_parent,
    memfd_maps,
    metric,
    random_model,
    wait_until,
    write_catalog,
    write_safetensors,
)

torch = pytest.importorskip("torch")


@pytest.fixture
def node(tmp_path):
    """Two models (one of two files), a catalog, and a started daemon."""
    root = tmp_path / "models"
    root.mkdir()
    models = {"a": random_model(1), "b0": random_model(2, 16, 8),
              "b1": {"extra": np.arange(10, dtype=np.float32)}}
    write_safetensors(root / "a.safetensors", models["a"])
    write_safetensors(root / "b0.safetensors", models["b0"])
    write_safetensors(root / "b1.safetensors", models["b1"])
    write_catalog(tmp_path / "catalog.json", [
        {"id": "a", "files": ["a.safetensors"], "aliases": ["alpha"]},
        {"id": "b", "files": ["b0.safetensors", "b1.safetensors"]},
    ])
    daemons = []

    def start(**kwargs) -> Daemon:
        d = Daemon(tmp_path, tmp_path / "catalog.json", root, **kwargs).start()
        daemons.append(d)
        return d

    start.models = models
    start.root = root
    start.tmp = tmp_path
    yield start
    for d in daemons:
        d.stop()


def test_the_daemon_and_the_package_name_the_projects_version(node):
    cmake = (Path(__file__).resolve().parents[2] / "CMakeLists.txt").read_text()
    project = re.search(r"^project\(modelcache VERSION ([0-9.]+)\b", cmake,
                        re.M).group(1)
    assert modelcache.__version__ == project
    with modelcache.serve.connect(node().socket) as client:
        assert client.info()["server"] == "modelcache " + project


def test_acquire_views_equal_the_files_and_are_read_only(node):
    daemon = node()
    client = modelcache.serve.connect(daemon.socket)
    with client.acquire("alpha", timeout=30) as lease:
        assert lease.model == "a"
        # In data order: the writer lays tensors out by decreasing element
        # size (steps is I64), in the order given among equal sizes.
        assert lease.names() == ["steps", "weight", "bias"]
        assert lease.tensors()["weight"] == {"dtype": "F32", "shape": [64, 32],
                                             "file": "a/a.safetensors"}
        arrays = lease.numpy()
        for name, expected in node.models["a"].items():
            np.testing.assert_array_equal(arrays[name], expected)
            assert not arrays[name].flags.writeable
        with pytest.raises(ValueError):
            arrays["weight"][0, 0] = 1.0
        assert lease.bytes == sum(t.nbytes for t in node.models["a"].values())
    with client.acquire("b", timeout=30) as lease:
        assert [p for p, _ in lease.files()] == ["b/b0.safetensors",
                                                 "b/b1.safetensors"]
        np.testing.assert_array_equal(lease.numpy("extra"),
                                      node.models["b1"]["extra"])
        np.testing.assert_array_equal(lease.numpy("weight"),
                                      node.models["b0"]["weight"])


def test_torch_is_zero_copy_and_copy_true_owns_its_memory(node):
    daemon = node()
    client = modelcache.serve.connect(daemon.socket)
    with client.acquire("a") as lease:
        shared = lease.torch()
        owned = lease.torch(copy=True)
        array = lease.numpy("weight")
        assert shared["weight"].data_ptr() == array.ctypes.data
        assert owned["weight"].data_ptr() != array.ctypes.data
        for name, expected in node.models["a"].items():
            assert torch.equal(shared[name], torch.from_numpy(expected))
            assert torch.equal(owned[name], shared[name])
        owned["weight"].add_(1.0)  # the caller's own memory
        np.testing.assert_array_equal(array, node.models["a"]["weight"])


def test_a_view_keeps_the_mapping_and_the_lease_until_it_is_gone(node):
    daemon = node()
    # keep_idle=0: no idle delegation (test_delegation.py), so the end of the
    # last view ends the lease.
    client = modelcache.serve.connect(daemon.socket, keep_idle=0)
    lease = client.acquire("a")
    array = lease.numpy("weight")
    tensor = lease.torch("bias")
    lease.release()
    assert lease.released
    with pytest.raises(errors.FailedPreconditionError):
        lease.numpy("weight")
    # Released, but views remain: still mapped here, still leased there.
    assert [l["pid"] for l in daemon.leases("a")] == [os.getpid()]
    assert memfd_maps(os.getpid(), "a#0")
    np.testing.assert_array_equal(array, node.models["a"]["weight"])
    del array
    gc.collect()
    assert [l["pid"] for l in daemon.leases("a")] == [os.getpid()]  # the tensor
    assert torch.equal(tensor, torch.from_numpy(node.models["a"]["bias"]))
    del tensor
    gc.collect()
    # The last view is gone: unmapped here, then released there.
    assert not memfd_maps(os.getpid(), "a#0")
    wait_until(lambda: daemon.leases("a") == [], "the daemon ends the lease")


def test_errors_are_the_package_classes_with_the_daemon_code(node):
    root = node.root
    write_safetensors(root / "big.safetensors",
                      {"w": np.zeros(3 << 20, dtype=np.float32)})  # 12 MiB
    # Valid while the daemon starts, broken before its first load: the load
    # finds it so, and the model is unavailable.
    write_safetensors(root / "bad.safetensors", {"w": np.zeros(4, dtype=np.float32)})
    write_catalog(node.tmp / "catalog.json", [
        {"id": "a", "files": ["a.safetensors"]},
        {"id": "big", "files": ["big.safetensors"]},
        {"id": "bad", "files": ["bad.safetensors"]},
    ])
    daemon = node(capacity="8MiB")
    (root / "bad.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b'{"w": 1}')
    client = modelcache.serve.connect(daemon.socket)
    with pytest.raises(errors.NotFoundError) as e:
        client.acquire("nope")
    assert e.value.serve_code == "NOT_FOUND" and isinstance(e.value, KeyError)
    with pytest.raises(errors.TooLargeError) as e:
        client.acquire("big")
    assert e.value.serve_code == "TOO_LARGE"
    with pytest.raises(errors.UnavailableError) as e:
        client.acquire("bad")
    assert e.value.serve_code == "UNAVAILABLE"
    assert e.value.cause == "invalid_data"
    assert "bad.safetensors" in str(e.value)
    assert not isinstance(e.value, errors.DaemonUnavailableError)
    with pytest.raises(errors.InvalidArgumentError):
        client.acquire("a", when_full="sometimes")
    with pytest.raises(errors.DaemonUnavailableError) as e:
        modelcache.serve.connect(node.tmp / "nobody.sock")
    assert e.value.serve_code == "UNAVAILABLE"
    assert isinstance(e.value, ConnectionError)
    assert isinstance(e.value, errors.UnavailableError)


def test_capacity_and_timeout(node):
    root = node.root
    for name in ("x", "y"):
        write_safetensors(root / f"{name}.safetensors",
                          {"w": np.ones(1 << 20, dtype=np.float32)})  # 4 MiB
    write_catalog(node.tmp / "catalog.json", [
        {"id": "x", "files": ["x.safetensors"]},
        {"id": "y", "files": ["y.safetensors"]},
    ])
    daemon = node(capacity="6MiB")
    client = modelcache.serve.connect(daemon.socket)
    held = client.acquire("x")
    with pytest.raises(errors.CapacityError) as e:
        client.acquire("y", when_full="fail")
    assert e.value.serve_code == "CAPACITY"
    assert "x" in str(e.value)  # names what holds the memory
    with pytest.raises(errors.TimeoutError) as e:
        client.acquire("y", timeout=0.2, when_full="wait")
    assert e.value.serve_code == "TIMEOUT"
    held.release()
    with client.acquire("y", when_full="fail") as y:
        assert y.numpy("w")[0] == 1.0


def test_the_gil_is_released_while_an_acquire_waits(node):
    daemon = node(gate=True)
    client = modelcache.serve.connect(daemon.socket)
    got = []
    waiter = threading.Thread(target=lambda: got.append(client.acquire("a")))
    waiter.start()
    # The load is held at the gate; this thread runs Python meanwhile (it
    # could not if the waiting thread held the GIL) and sees the wait.
    wait_until(lambda: daemon.get("/v1/budget")["waiting_acquires"] == 1,
               "the acquire starts a load")
    assert not got
    client.ping()  # the client serves another call while one waits
    daemon.open_gate()
    waiter.join(timeout=60)
    assert not waiter.is_alive() and got[0].model == "a"
    got[0].release()


def test_load_says_hit_miss_or_joined(node):
    daemon = node(gate=True)
    client = modelcache.serve.connect(daemon.socket)
    first = []
    starter = threading.Thread(target=lambda: first.append(client.acquire("a")))
    starter.start()
    wait_until(lambda: daemon.get("/v1/budget")["waiting_acquires"] == 1,
               "the first acquire starts the load")
    second = []
    joiner = threading.Thread(target=lambda: second.append(client.acquire("alpha")))
    joiner.start()
    wait_until(lambda: daemon.get("/v1/budget")["waiting_acquires"] == 2,
               "the second acquire waits too")
    daemon.open_gate()
    starter.join(timeout=60)
    joiner.join(timeout=60)
    assert first[0].load == "miss" and second[0].load == "joined"
    # Another client: its acquire is a round trip (this one's would be
    # local, as its leases on "a" are alive).
    with modelcache.serve.connect(daemon.socket).acquire("a") as third:
        assert third.load == "hit"
    assert daemon.model("a")["loads"] == 1
    first[0].release()
    second[0].release()


CHILD_PRELUDE = """
import os, signal, sys
import modelcache.serve
from modelcache import errors
client = modelcache.serve.connect(sys.argv[1])
"""


def _run_child(code: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(code), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=die_with_parent, **kw)


def test_ctrl_c_ends_a_wait(node):
    daemon = node(gate=True)
    child = _run_child("""
        try:
            client.acquire("a", timeout=None)
            print("acquired")
        except KeyboardInterrupt:
            print("interrupted")
        client.ping()   # the connection still works
        print("ok")
    """, daemon.socket)
    try:
        wait_until(lambda: daemon.get("/v1/budget")["waiting_acquires"] == 1,
                   "the child's acquire waits for the load")
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=60)
    finally:
        child.kill()
        child.wait()
    assert out.split() == ["interrupted", "ok"], out
    wait_until(lambda: daemon.get("/v1/budget")["waiting_acquires"] == 0,
               "the interrupted acquire no longer waits")
    assert daemon.leases("a") == []


def test_a_forked_child_has_no_lease_and_connects_again(node):
    daemon = node()
    child = _run_child("""
        import gc, numpy as np
        lease = client.acquire("a")
        array = lease.numpy("weight")
        parent_lease = lease.lease_id
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                assert lease.released
                try:
                    lease.numpy("weight")
                    raise SystemExit("a view in the child")
                except errors.FailedPreconditionError:
                    pass
                mine = client.acquire("a")   # a fresh connection
                assert mine.lease_id != parent_lease
                np.testing.assert_array_equal(mine.numpy("weight"), array)
                os.write(w, str(mine.lease_id).encode())
                os.close(w)
                sys.stdin.read()             # hold it until told
                os._exit(0)
            except BaseException as e:
                os.write(w, repr(e).encode()); os._exit(1)
        os.close(w)
        child_lease = os.read(r, 100).decode()
        print(pid, parent_lease, child_lease, flush=True)
        sys.stdin.read()
        np.testing.assert_array_equal(array, lease.numpy("weight"))
        os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)
        print("parent ok", flush=True)
    """, daemon.socket, stdin=subprocess.PIPE)
    try:
        line = child.stdout.readline().split()
        assert len(line) == 3 and line[2].isdigit(), line
        grandchild, parent_lease, child_lease = map(int, line)
        holders = {(l["pid"], l["lease"]) for l in daemon.leases("a")}
        assert holders == {(child.pid, parent_lease),
                           (grandchild, child_lease)}
        out, _ = child.communicate("go\n", timeout=60)
    finally:
        child.kill()
        child.wait()
    assert "parent ok" in out, out
    wait_until(lambda: daemon.leases("a") == [], "both leases end")


def test_daemon_killed_and_restarted(node):
    daemon = node()
    # Without reclaim: the successor books the mapped copy as orphaned
    # (test_delegation and the C++ reclaim suite cover reclaim).
    client = modelcache.serve.connect(daemon.socket, reclaim=False)
    lease = client.acquire("a")
    arrays = lease.numpy()
    daemon.kill()
    # Mapped copies stay valid without the daemon.
    np.testing.assert_array_equal(arrays["weight"], node.models["a"]["weight"])
    with pytest.raises(errors.DaemonUnavailableError):
        client.acquire("b", timeout=0.5)
    lease.release()
    restarted = node()
    # The new daemon books the copy this process still maps as orphaned.
    wait_until(lambda: restarted.get("/v1/budget")["orphaned_bytes"] > 0,
               "the restarted daemon finds the mapped copy")
    with client.acquire("b", timeout=30) as b:  # reconnects
        np.testing.assert_array_equal(b.numpy("extra"),
                                      node.models["b1"]["extra"])
    del arrays
    gc.collect()
    assert not memfd_maps(os.getpid(), "a#0")
    wait_until(lambda: restarted.get("/v1/budget")["orphaned_bytes"] == 0,
               "the orphaned copy is freed once unmapped")


def origins(daemon: Daemon) -> dict:
    return {c["model"]: c["origin"] for c in daemon.get("/v1/copies")["copies"]}


def test_a_killed_daemons_successor_gets_the_mapped_copy_back(node):
    daemon = node()
    client = modelcache.serve.connect(daemon.socket)  # reclaim=True
    lease = client.acquire("a")
    arrays = lease.numpy()
    daemon.kill()
    restarted = node()
    # No call: the client's keeper reconnects and reclaims the lease.
    wait_until(lambda: client.reclaims()["reclaimed"] == 1,
               "the lease reclaimed on the successor")
    assert client.reclaims()["pending"] == 0
    assert metric(restarted, "modelcache_loads_total") == 0
    assert origins(restarted) == {"a": "reclaimed"}
    assert restarted.get("/v1/budget")["orphaned_bytes"] == 0
    np.testing.assert_array_equal(arrays["weight"], node.models["a"]["weight"])
    del arrays
    lease.release()  # kept idle by the client (keep_idle), or ended
    wait_until(lambda: all(l["use"] == "idle" for l in restarted.leases("a")),
               "the reclaimed lease is released as any")
    # A new acquire is a hit on the same copy.
    with client.acquire("a") as again:
        np.testing.assert_array_equal(again.numpy("weight"),
                                      node.models["a"]["weight"])
    assert metric(restarted, "modelcache_loads_total") == 0
    client.close()
    wait_until(lambda: restarted.leases("a") == [], "the reclaimed lease ends")


def test_a_takeover_keeps_the_lease_and_loads_nothing(node):
    old = node()
    client = modelcache.serve.connect(old.socket)
    lease = client.acquire("b")
    arrays = lease.numpy()
    assert metric(old, "modelcache_loads_total") == 1
    new = node(extra=["--takeover"])
    assert old.proc.wait(timeout=60) == 0  # the old daemon exits 0
    wait_until(lambda: client.reclaims()["reclaimed"] == 1,
               "the held lease reclaimed on the new daemon")
    assert metric(new, "modelcache_loads_total") == 0
    assert origins(new) == {"b": "taken over"}
    np.testing.assert_array_equal(arrays["extra"], node.models["b1"]["extra"])
    with client.acquire("a", timeout=30) as a:  # the new daemon serves
        np.testing.assert_array_equal(a.numpy("weight"),
                                      node.models["a"]["weight"])
    del arrays
    lease.release()  # kept idle by the client (keep_idle), or ended
    wait_until(lambda: all(l["use"] == "idle" for l in new.leases("b")),
               "the held lease is released as any")
    client.close()
    wait_until(lambda: new.leases("b") == [], "the held lease ends there")


def test_register_cuda_says_why_it_is_skipped_without_a_gpu(node):
    daemon = node()
    client = modelcache.serve.connect(daemon.socket)
    with client.acquire("a") as lease:
        reason = lease.register_cuda()
        if torch.cuda.is_available():
            assert reason is None and lease.cuda_registered
        else:
            assert "CUDA" in reason and not lease.cuda_registered


def test_a_model_kept_busy_by_other_clients_drains_for_a_waiting_acquire(node):
    # Room for one model; other clients keep 'x' in use, one after another
    # with overlapping leases, while one waits for 'y'. --drain-after 0:
    # 'x' drains at once, its next acquire queues, 'y' is served when the
    # lease out ends, and the queued acquire of 'x' goes on after 'y'.
    root = node.root
    for name, value in (("x", 1.0), ("y", 2.0)):
        write_safetensors(root / f"{name}.safetensors",
                          {"w": np.full(1 << 20, value, dtype=np.float32)})
    write_catalog(node.tmp / "catalog.json", [
        {"id": "x", "files": ["x.safetensors"]},
        {"id": "y", "files": ["y.safetensors"]},
    ])
    daemon = node(capacity="6MiB", extra=["--drain-after", "0"])
    # One client each, none keeping idle leases: every acquire goes to the
    # daemon.
    holder, next_holder, waiter = (
        modelcache.serve.connect(daemon.socket, keep_idle=0) for _ in range(3))
    held = holder.acquire("x")
    served = {}

    def acquire(name, client, model):
        served[name] = client.acquire(model, timeout=60, when_full="wait")

    wants_y = threading.Thread(target=acquire, args=("y", waiter, "y"))
    wants_y.start()
    wait_until(lambda: metric(daemon, "modelcache_drains_total") >= 1,
               "'x' draining for 'y'")
    wants_x = threading.Thread(target=acquire, args=("x", next_holder, "x"))
    wants_x.start()
    wait_until(lambda: metric(daemon, "modelcache_queued_behind_drain_total") >= 1,
               "the next acquire of 'x' queued behind its drain")
    assert "x" not in served and "y" not in served

    held.release()
    wants_y.join(60)
    assert served["y"].numpy("w")[0] == 2.0
    assert "x" not in served  # it waits for room in its turn
    served["y"].release()
    wants_x.join(60)
    assert served["x"].numpy("w")[0] == 1.0
    served["x"].release()
    for client in (holder, next_holder, waiter):
        client.close()
