"""Delegated leases from Python (issue: a worker's warm acquire without a
round trip): a second acquire of a model this process holds is local; a
lease no object or view uses is kept idle, which the daemon counts as
evictable and recalls when it needs the room; keep_idle=0 releases at once.

Each test starts its own daemon and stops it by pid. What the daemon holds
is read from its HTTP API (/v1/models, /metrics over the admin socket) and
from /proc/<pid>/maps, polled with a bound; another process is ordered
through its pipes, never by sleeping.
"""

from __future__ import annotations

import datetime
import gc
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import modelcache.errors
import modelcache.serve

from serve_util import (
    Daemon,
    die_with_parent,
    memfd_maps,
    metric,
    wait_until,
    write_catalog,
    write_safetensors,
)


@pytest.fixture
def node(tmp_path):
    """Two 4 MiB models, x and y, and a daemon with room for one of them."""
    root = tmp_path / "models"
    root.mkdir()
    for i, name in enumerate(("x", "y")):
        write_safetensors(root / f"{name}.safetensors",
                          {"w": np.full(1 << 20, i + 1, dtype=np.float32)})
    write_catalog(tmp_path / "catalog.json", [
        {"id": "x", "files": ["x.safetensors"], "aliases": ["ex"]},
        {"id": "y", "files": ["y.safetensors"]},
    ])
    daemon = Daemon(tmp_path, tmp_path / "catalog.json", root,
                    capacity="6MiB").start()
    yield daemon
    daemon.stop()


def uses(daemon: Daemon, model: str):
    """(pid, lease, use) of every lease the daemon holds on `model`."""
    return [(l["pid"], l["lease"], l["use"]) for l in daemon.leases(model)]


def test_a_second_acquire_in_the_process_is_local(node):
    client = modelcache.serve.connect(node.socket)
    first = client.acquire("x")
    assert first.load == "miss"
    second = client.acquire("x")
    # The same lease and mapping, found here: the daemon holds one lease.
    assert (second.lease_id, second.load) == (first.lease_id, "local")
    assert second.numpy("w").ctypes.data == first.numpy("w").ctypes.data
    assert uses(node, "x") == [(os.getpid(), first.lease_id, "in_use")]
    assert len(memfd_maps(os.getpid(), ":x#")) == 1
    first.release()
    # One reference remains: still in use, not idle.
    assert client.idle_leases() == 0
    assert uses(node, "x") == [(os.getpid(), first.lease_id, "in_use")]
    second.release()
    wait_until(lambda: client.idle_leases() == 1, "the lease is kept idle")


def test_a_released_lease_is_kept_idle_and_revived(node):
    client = modelcache.serve.connect(node.socket)
    lease = client.acquire("x")
    view = lease.numpy("w")
    lease.release()
    # A view still uses the copy: an acquire now is local, the lease in use.
    again = client.acquire("x")
    assert (again.lease_id, again.load) == (lease.lease_id, "local")
    again.release()
    assert client.idle_leases() == 0
    del view
    gc.collect()
    # No object or view uses it: kept, mapped, and told to the daemon as
    # idle, which counts it apart from leases in use.
    wait_until(lambda: uses(node, "x") == [(os.getpid(), lease.lease_id, "idle")],
               "the daemon books the lease as idle")
    assert client.idle_leases() == 1
    assert memfd_maps(os.getpid(), ":x#")
    assert metric(node, "modelcache_delegated_leases", 'use="idle"') == 1
    assert metric(node, "modelcache_delegated_leases", 'use="in_use"') == 0
    # The next acquire revives it: the same lease, no round trip.
    revived = client.acquire("x")
    assert (revived.lease_id, revived.load) == (lease.lease_id, "local")
    assert client.idle_leases() == 0
    np.testing.assert_array_equal(revived.numpy("w")[:3], [1.0, 1.0, 1.0])
    wait_until(lambda: uses(node, "x") == [(os.getpid(), lease.lease_id, "in_use")],
               "the daemon books the revived lease as in use")
    assert metric(node, "modelcache_recalls_sent_total") == 0
    assert node.model("x")["loads"] == 1
    revived.release()


def test_reclaims_count_nothing_without_a_lost_connection(node):
    # The daemon does not offer reclaim yet: nothing is pending or counted,
    # with the memfds kept (the default) or not.
    for reclaim in (True, False):
        client = modelcache.serve.connect(node.socket, reclaim=reclaim)
        lease = client.acquire("x")
        assert float(lease.numpy("w")[0]) == 1.0
        assert client.reclaims() == {"reclaimed": 0, "reclaim_refused": 0,
                                     "reclaim_unsupported": 0, "pending": 0}
        lease.release()
        client.close()
    with pytest.raises(TypeError, match="reclaim must be a bool"):
        modelcache.serve.connect(node.socket, reclaim=1)


def test_idle_notice_delay_sets_when_the_daemon_hears_of_an_idle_lease(node):
    # A delay longer than the test: the lease is idle here, and the daemon,
    # never told, books it in use (a ping orders what the client sent).
    late = modelcache.serve.connect(node.socket, idle_notice_delay=3600)
    held = late.acquire("x")
    held.release()
    assert late.idle_leases() == 1
    late.ping()
    # No delay: told at the release itself, before the ping behind it.
    prompt = modelcache.serve.connect(
        node.socket, idle_notice_delay=datetime.timedelta(0))
    told = prompt.acquire("x")
    assert told.load == "hit"
    told.release()
    prompt.ping()
    assert sorted(uses(node, "x")) == sorted([
        (os.getpid(), held.lease_id, "in_use"),
        (os.getpid(), told.lease_id, "idle")])
    # Revived at once: still local, and the daemon's books are unchanged.
    again = late.acquire("x")
    assert (again.lease_id, again.load) == (held.lease_id, "local")
    again.release()
    for bad, error in ((-1, modelcache.errors.InvalidArgumentError),
                       (None, TypeError), ("1", TypeError)):
        with pytest.raises(error, match="idle_notice_delay"):
            modelcache.serve.connect(node.socket, idle_notice_delay=bad)


def test_keep_idle_zero_releases_at_once(node):
    client = modelcache.serve.connect(node.socket, keep_idle=0)
    lease = client.acquire("x")
    local = client.acquire("x")  # a live reference is still shared
    assert (local.lease_id, local.load) == (lease.lease_id, "local")
    lease.release()
    local.release()
    assert client.idle_leases() == 0
    assert not memfd_maps(os.getpid(), ":x#")  # unmapped before it returns
    wait_until(lambda: uses(node, "x") == [], "the daemon ends the lease")
    again = client.acquire("x")
    assert again.lease_id != lease.lease_id and again.load == "hit"
    again.release()


CHILD = """
import sys
import modelcache.serve
client = modelcache.serve.connect(sys.argv[1])
lease = client.acquire(sys.argv[2], timeout=60)
print(lease.load, lease.lease_id, float(lease.numpy("w")[0]), flush=True)
sys.stdin.read()   # holds the lease until told
lease.release()
print("released", flush=True)
"""


def test_another_process_needing_the_room_recalls_an_idle_lease(node):
    client = modelcache.serve.connect(node.socket)
    with client.acquire("ex") as x:
        held = x.lease_id
    wait_until(lambda: uses(node, "x") == [(os.getpid(), held, "idle")],
               "the daemon books the lease as idle")
    # y does not fit beside x: the daemon recalls this process's idle lease,
    # whose client unmaps it and answers release, and y loads.
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CHILD), node.socket, "y"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, preexec_fn=die_with_parent)
    try:
        line = child.stdout.readline().split()
        assert len(line) == 3 and line[0] == "miss" and line[2] == "2.0", line
        assert metric(node, "modelcache_recalls_sent_total") == 1
        assert metric(node, "modelcache_recalls_total", 'answer="release"') == 1
        assert metric(node, "modelcache_recalls_total", 'answer="busy"') == 0
        assert metric(node, "modelcache_recalls_total", 'answer="unanswered"') == 0
        assert uses(node, "x") == []
        assert client.idle_leases() == 0
        assert not memfd_maps(os.getpid(), ":x#")  # unmapped before answering
        assert uses(node, "y") == [(child.pid, int(line[1]), "in_use")]
        out, _ = child.communicate("go\n", timeout=60)
        assert out.split() == ["released"], out
    finally:
        child.kill()
        child.wait()
    # The recalled lease is gone: the next acquire is a round trip, a new
    # lease, and loads x again (y, no longer leased, is evicted).
    with client.acquire("x") as again:
        assert again.lease_id != held and again.load == "miss"
        assert again.numpy("w")[0] == 1.0
    assert node.model("x")["loads"] == 2


FAIL_CHILD = """
import sys
import modelcache.errors
import modelcache.serve
client = modelcache.serve.connect(sys.argv[1], keep_idle=0)
try:
    with client.acquire(sys.argv[2], timeout=60, when_full="fail") as lease:
        print(lease.load, float(lease.numpy("w")[0]), flush=True)
except modelcache.errors.CapacityError as e:
    print("CAPACITY", e, flush=True)
"""


def test_an_acquire_after_a_release_returned_finds_its_room(node):
    # The case: this worker's `with` block ends (the call returns)
    # before its idle notice goes (10 s later); then another worker,
    # started after, acquires the other model with when_full="fail".
    client = modelcache.serve.connect(node.socket, idle_notice_delay=10.0)
    with client.acquire("x") as x:
        held = x.lease_id
    assert uses(node, "x") == [(os.getpid(), held, "in_use")]
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FAIL_CHILD), node.socket, "y"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=60, preexec_fn=die_with_parent)
    # The daemon recalled the lease it counted in use; this process had no
    # reference left, so it unmapped the copy and answered release.
    assert child.stdout.split() == ["miss", "2.0"], child.stdout
    assert metric(node, "modelcache_recalls_total", 'answer="release"') == 1
    assert client.idle_leases() == 0
    assert not memfd_maps(os.getpid(), ":x#")


CLOSER = """
import os, sys
import modelcache.serve
from serve_util import memfd_maps
client = modelcache.serve.connect(sys.argv[1])
with client.acquire("x") as lease:
    first = lease.lease_id
assert client.idle_leases() == 1
client.close()   # the connection ends: its idle lease is dropped, unmapped
assert client.idle_leases() == 0
assert not memfd_maps(os.getpid(), ":x#")
lease = client.acquire("x")   # connects again: a new lease
assert lease.lease_id != first and lease.load == "hit", lease.load
array = lease.numpy("w")
client.close()   # a copy in use keeps its mapping
assert float(array[-1]) == 1.0
lease.release()
del array
print("ok", flush=True)
"""


def test_close_drops_idle_leases_and_keeps_those_in_use(node):
    # In a child: a crash there (Client.close with leases held) is this
    # test's failure, not the end of the suite.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.environ.get("PYTHONPATH", ""), os.path.dirname(__file__)]))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CLOSER), node.socket],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        timeout=120, preexec_fn=die_with_parent)
    assert (done.returncode, done.stdout.split()[-1:]) == (0, ["ok"]), done.stdout
    wait_until(lambda: uses(node, "x") == [], "the daemon ends both leases")


def test_acquire_local_answers_only_for_held_models_and_without_the_daemon(node):
    client = modelcache.serve.connect(node.socket)
    # Not held: None, and nothing was asked of the daemon.
    assert client.acquire_local("x") is None
    assert uses(node, "x") == [] and node.model("x")["loads"] == 0
    lease = client.acquire("x")
    local = client.acquire_local("ex")  # not under this name: not local
    assert local is None
    local = client.acquire_local("x")
    assert (local.lease_id, local.load) == (lease.lease_id, "local")
    local.release()
    lease.release()
    wait_until(lambda: client.idle_leases() == 1, "the lease is kept idle")
    node.kill()
    # The client's own thread sees the connection end: the idle lease waits
    # to be reclaimed, still mapped, and serves a local acquire meanwhile.
    wait_until(lambda: client.reclaims()["pending"] == 1,
               "the lease waits to be reclaimed")
    during = client.acquire_local("x")
    assert (during.lease_id, during.load) == (lease.lease_id, "local")
    assert during.numpy("w")[0] == 1.0
    assert client.acquire_local("y") is None
    during.release()
    node.start()
    wait_until(lambda: client.reclaims()["reclaimed"] == 1,
               "the successor adopts the lease")
    assert node.model("x")["loads"] == 0


def test_a_lease_waiting_to_be_reclaimed_stays_mapped_whatever_keep_idle_says(node):
    # keep_idle=0: with the daemon up, a lease ends with its last reference.
    client = modelcache.serve.connect(node.socket, keep_idle=0)
    lease = client.acquire("x")
    node.kill()
    wait_until(lambda: client.reclaims()["pending"] == 1,
               "the lease waits to be reclaimed")
    # Its last reference ends during the outage: kept idle and mapped, not
    # lost, and it serves a local acquire.
    lease.release()
    assert client.idle_leases() == 1
    assert len(memfd_maps(os.getpid(), ":x#")) == 1
    during = client.acquire_local("x")
    assert during is not None and during.lease_id == lease.lease_id
    during.release()
    node.start()
    # Reclaimed, loading nothing; then keep_idle=0 ends it.
    wait_until(lambda: client.reclaims()["reclaimed"] == 1,
               "the successor adopts the lease")
    assert node.model("x")["loads"] == 0
    wait_until(lambda: client.idle_leases() == 0 and uses(node, "x") == [],
               "the reclaimed idle lease ends, keep_idle being 0")
    assert memfd_maps(os.getpid(), ":x#") == []
