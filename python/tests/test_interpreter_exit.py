"""Exiting the interpreter while caches still hold Python objects neither
crashes nor hangs: caches in module globals, leases held by daemon threads,
daemon threads blocked inside the cache, and loads still running.

Each case runs a fresh interpreter (the one running this suite) and checks
that it exits with status 0, printed its last line, and did so within a
bound that only turns a hang into a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent(
    """
    import threading
    import modelcache

    class Model:
        def __init__(self, key):
            self.key = key
            self.payload = bytearray(1024)

        def __del__(self):
            # Runs only with the GIL; touching an object proves it.
            self.payload[0] = 1
    """
)

CASES = {
    "cache_in_a_global_with_unloaders": """
        unloaded = []
        CACHE = modelcache.Cache(capacity_bytes=10_000)
        for i in range(5):
            CACHE.prefetch("m%d" % i, lambda i=i: modelcache.Loaded(
                Model(i), 1000, unload=lambda: unloaded.append(i)), 1000)
        LEASE = CACHE.acquire("m0", lambda: Model(0), 1000)
        print("done", flush=True)
    """,
    "daemon_thread_holding_a_lease": """
        CACHE = modelcache.Cache(capacity_bytes=10_000)
        holding = threading.Event()
        def hold():
            with CACHE.acquire("k", lambda: Model("k"), 1000) as m:
                holding.set()
                threading.Event().wait()  # forever
        threading.Thread(target=hold, daemon=True).start()
        assert holding.wait(60)
        print("done", flush=True)
    """,
    "daemon_threads_blocked_in_the_cache": """
        CACHE = modelcache.Cache(capacity_bytes=10_000)
        loading = threading.Event()
        never = threading.Event()
        def slow_load():
            loading.set()
            never.wait()
            return Model("k")
        threading.Thread(target=lambda: CACHE.acquire("k", slow_load, 1000),
                         daemon=True).start()
        assert loading.wait(60)
        waiters = [threading.Thread(
            target=lambda: CACHE.acquire("k", lambda: Model("k"), 1000),
            daemon=True) for _ in range(4)]
        for t in waiters:
            t.start()
        while CACHE.entry("k").waiters < 4:
            pass
        # And one waiting for capacity.
        full = modelcache.Cache(capacity_bytes=1000)
        held = full.acquire("a", lambda: Model("a"), 1000)
        threading.Thread(target=lambda: full.acquire(
            "b", lambda: Model("b"), 1000, when_full="wait"), daemon=True).start()
        while full.budget.waiters < 1:
            pass
        print("done", flush=True)
    """,
    "load_finishing_while_the_interpreter_exits": """
        CACHE = modelcache.Cache(capacity_bytes=10_000)
        loading = threading.Event()
        def load():
            loading.set()
            # Released by the exit itself: the event is set from an atexit
            # handler, so this load completes while the interpreter is
            # finalizing, and its value is dropped by a daemon thread.
            go.wait()
            return Model("k")
        go = threading.Event()
        import atexit
        atexit.register(go.set)
        def worker():
            CACHE.acquire("k", load, 1000).release()
            CACHE.prune()
        threading.Thread(target=worker, daemon=True).start()
        assert loading.wait(60)
        print("done", flush=True)
    """,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_interpreter_exits_cleanly(case):
    script = PRELUDE + textwrap.dedent(CASES[case])
    proc = subprocess.run(
        [sys.executable, "-X", "dev", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("done"), proc.stdout + proc.stderr
    assert "Fatal Python error" not in proc.stderr
    assert "terminate called" not in proc.stderr
