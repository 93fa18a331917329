"""The cache's contract from Python: single flight, leases that block
eviction, exact budgets, failures not cached, errors, and the threading rules
(GIL released while blocked, re-entry, values released with the GIL,
KeyboardInterrupt ends a blocked wait).

Written from the docstrings and docs/python.md, not from the bindings' code.
"""

from __future__ import annotations

import _thread
import builtins
import datetime
import gc
import sys
import threading
import weakref
from typing import List

import pytest

import modelcache
from conftest import spin_until


class Model:
    """A stand-in model: records its key and which load made it."""

    def __init__(self, key: str, generation: int = 1) -> None:
        self.key = key
        self.generation = generation


def waiters_on(cache: modelcache.Cache, key: str) -> int:
    e = cache.entry(key)
    return 0 if e is None else e.waiters


# ---- basics ----


def test_acquire_loads_once_then_hits_and_the_lease_is_a_context_manager():
    cache = modelcache.Cache(capacity_bytes=100)
    calls = []

    def load():
        calls.append(1)
        return Model("a")

    with cache.acquire("a", load, 10) as model:
        assert isinstance(model, Model) and model.key == "a"
        assert cache.entry("a").leases == 1
    assert cache.entry("a").leases == 0
    lease = cache.acquire("a", load, 10)
    assert lease.value.key == "a" and lease.key == "a" and lease.bytes == 10
    assert len(calls) == 1
    s = cache.stats()
    assert (s.hits, s.misses, s.loads, s.resident_bytes) == (1, 1, 1, 10)
    assert s.as_dict()["loads"] == 1
    lease.release()
    lease.release()  # idempotent
    assert lease.released
    with pytest.raises(modelcache.FailedPreconditionError):
        lease.value
    assert cache.stats().budget_used_bytes == 10
    assert cache.check_invariants() == 10


def test_loaded_gives_the_real_size_and_an_unloader():
    unloaded = []
    cache = modelcache.Cache(capacity_bytes=100)
    with cache.acquire(
        "a", lambda: modelcache.Loaded(Model("a"), 30, unload=lambda: unloaded.append("a")), 10
    ) as m:
        assert m.key == "a"
    assert cache.entry("a").bytes == 30
    assert cache.budget.used == 30
    assert cache.remove("a") == "removed"
    assert unloaded == ["a"]
    assert cache.budget.used == 0
    assert cache.remove("a") == "not_found"


def test_get_never_loads():
    cache = modelcache.Cache(capacity_bytes=100)
    assert cache.get("a") is None
    cache.prefetch("a", lambda: Model("a"), 10)
    lease = cache.get("a")
    assert lease is not None and lease.value.key == "a"
    assert cache.entry("a").leases == 1
    lease.release()


def test_a_lease_collected_without_release_is_released():
    cache = modelcache.Cache(capacity_bytes=100)
    lease = cache.acquire("a", lambda: Model("a"), 10)
    assert cache.entry("a").leases == 1
    del lease
    gc.collect()
    assert cache.entry("a").leases == 0
    assert cache.prune() == 1


def test_errors_are_modelcache_errors_and_builtins_where_they_mean_the_same():
    cache = modelcache.Cache(capacity_bytes=100)
    with pytest.raises(modelcache.TooLargeError) as too_large:
        cache.acquire("huge", lambda: Model("huge"), 200)
    assert isinstance(too_large.value, modelcache.Error)
    assert "capacity" in str(too_large.value)
    held = cache.acquire("a", lambda: Model("a"), 80)
    with pytest.raises(modelcache.CapacityError, match="'a'"):
        cache.acquire("b", lambda: Model("b"), 40)
    with pytest.raises(builtins.TimeoutError):
        cache.acquire("b", lambda: Model("b"), 40, when_full="wait", timeout=0.01)
    with pytest.raises(modelcache.TimeoutError):
        cache.acquire(
            "b", lambda: Model("b"), 40, when_full="wait", timeout=datetime.timedelta(milliseconds=5)
        )
    held.release()
    with pytest.raises(KeyError):
        cache.pin("missing")
    with pytest.raises(modelcache.NotFoundError, match="missing"):
        cache.pin("missing")
    with pytest.raises(ValueError):
        modelcache.Cache(capacity_bytes=1, policy="no-such-policy")
    with pytest.raises(modelcache.InvalidArgumentError):
        cache.acquire("c", lambda: Model("c"), 1, when_full="sometimes")
    with pytest.raises(modelcache.InvalidArgumentError):
        cache.acquire("c", lambda: Model("c"), 1, timeout=-1)
    with pytest.raises(modelcache.InvalidArgumentError):
        modelcache.Cache()
    with pytest.raises(modelcache.InvalidArgumentError):
        modelcache.Cache(capacity_bytes=1, budget=modelcache.Budget(1))
    with pytest.raises(modelcache.InvalidArgumentError):
        modelcache.Cache(capacity_bytes=1, idle_ttl=-2)
    # Nothing above changed the books.
    s = cache.stats()
    assert (s.resident_entries, s.resident_bytes, s.budget_used_bytes) == (1, 80, 80)
    assert cache.check_invariants() == 80


def test_a_failed_load_is_not_cached_and_its_bytes_come_back():
    cache = modelcache.Cache(capacity_bytes=100)
    calls: List[int] = []

    def bad():
        calls.append(1)
        raise ValueError("broken checkpoint")

    for _ in range(2):
        with pytest.raises(ValueError, match="broken checkpoint"):
            cache.acquire("a", bad, 50)
    assert len(calls) == 2
    assert cache.budget.used == 0
    assert cache.entry("a") is None
    assert cache.stats().load_failures == 2
    with cache.acquire("a", lambda: Model("a"), 50) as m:
        assert m.key == "a"


def test_aliases_pins_prune_and_capacity():
    cache = modelcache.Cache(capacity_bytes=100, policy="gdsf")
    cache.prefetch("sdxl-1.0", lambda: Model("sdxl-1.0"), 40)
    cache.add_alias("sdxl", "sdxl-1.0")
    assert cache.resolve("sdxl") == "sdxl-1.0"
    with cache.acquire("sdxl", lambda: Model("never"), 40) as m:
        assert m.key == "sdxl-1.0"
    cache.pin("sdxl")
    assert cache.entry("sdxl-1.0").pinned
    assert cache.prune() == 0
    cache.unpin("sdxl")
    assert cache.remove_alias("sdxl") and not cache.remove_alias("sdxl")
    cache.prefetch("b", lambda: Model("b"), 40)
    assert {e.key for e in cache.entries()} == {"sdxl-1.0", "b"}
    assert all(e.state == "resident" for e in cache.entries())
    assert cache.set_capacity(50) == 0  # evicts one
    assert cache.stats().resident_entries == 1
    assert cache.prune() == 1
    assert cache.budget.used == 0


def test_every_policy_replay_recommends_runs_in_a_cache():
    names = modelcache.policy_names()
    assert "next-use-prewarm" in names and "hybrid-histogram" in names
    assert "belady" not in names and "belady" in modelcache.policy_names(offline=True)
    for name in names:
        name = "ttl-10m" if name == "ttl-<N>m" else name
        cache = modelcache.Cache(name, capacity_bytes=300, policy=name)
        for i in range(12):
            with cache.acquire("m%d" % (i % 4), lambda: Model("m"), 100):
                pass
        s = cache.stats()
        assert s.hits + s.misses - s.prewarms == 12, name
        assert cache.budget.used <= 300
        del cache  # a keep-alive policy's thread stops with its cache
        gc.collect()


def test_an_unknown_policy_names_every_valid_one():
    with pytest.raises(modelcache.InvalidArgumentError) as unknown:
        modelcache.Cache(capacity_bytes=10, policy="lfu")
    for name in modelcache.policy_names(offline=True):
        assert name in str(unknown.value)
    with pytest.raises(modelcache.InvalidArgumentError, match="ttl-10m"):
        modelcache.Cache(capacity_bytes=10, policy="ttl-soon")


def test_shard_bits_beyond_twelve_are_refused():
    modelcache.Cache(capacity_bytes=10, shard_bits=12)
    with pytest.raises(modelcache.InvalidArgumentError, match="0..12"):
        modelcache.Cache(capacity_bytes=10, shard_bits=13)


def test_stats_and_entries_have_the_fields_of_the_cpp_records():
    cache = modelcache.Cache(capacity_bytes=100)
    with cache.acquire("a", lambda: Model("a"), 10):
        pass
    stats = cache.stats()
    assert [f for f, _, _ in modelcache._core._cache_stats_fields()] == list(
        stats.as_dict()
    )
    assert stats.prewarms == 0 and stats.wasted_evictions == 0
    entry = cache.entry("a")
    assert entry.key == "a" and entry.state == "resident" and entry.bytes == 10
    assert isinstance(entry.last_use, float)


def test_a_request_that_cannot_fit_evicts_nothing():
    cache = modelcache.Cache("t", capacity_bytes=100)
    held = cache.acquire("a", lambda: Model("a"), 50)
    cache.acquire("b", lambda: Model("b"), 20).release()
    cache.acquire("c", lambda: Model("c"), 20).release()
    with pytest.raises(modelcache.CapacityError) as refused:
        cache.acquire("d", lambda: Model("d"), 60)
    # 40 B of idle models could never make room while "a" is leased.
    assert sorted(e.key for e in cache.entries()) == ["a", "b", "c"]
    assert cache.stats().evictions == 0
    assert "'a' (50 B, 1 lease)" in str(refused.value)
    assert "'d'" not in str(refused.value)
    held.release()


@pytest.mark.parametrize("policy", ["next-use", "next-use-uniform"])
def test_next_use_policy_evicts_a_model_requested_once_before_a_repeated_one(policy):
    cache = modelcache.Cache(capacity_bytes=100, policy=policy)
    for _ in range(3):
        with cache.acquire("repeated", lambda: Model("repeated"), 40):
            pass
    with cache.acquire("once", lambda: Model("once"), 40):
        pass  # the most recent: LRU would keep it and evict "repeated"
    with cache.acquire("new", lambda: Model("new"), 40):
        pass
    assert {e.key for e in cache.entries()} == {"repeated", "new"}


def test_a_ranked_prefetch_never_displaces_a_model_expected_sooner():
    cache = modelcache.Cache(capacity_bytes=80, policy="next-use")
    for _ in range(3):  # requested again and again: expected soon
        with cache.acquire("busy", lambda: Model("busy"), 40):
            pass
    # A prefetch is not a request: "warm" has no history, so under next-use
    # it ranks lowest, tied with "idle" (never requested either), and a
    # ranked prefetch of it may evict neither...
    cache.prefetch("idle", lambda: Model("idle"), 40)
    with pytest.raises(modelcache.errors.CapacityError):
        cache.prefetch("warm", lambda: Model("warm"), 40, evict_only_lower_ranked=True)
    assert {e.key for e in cache.entries()} == {"busy", "idle"}
    # ...while a plain prefetch makes room as usual (here, from "idle", which
    # was never requested).
    cache.prefetch("warm", lambda: Model("warm"), 40)
    assert {e.key for e in cache.entries()} == {"busy", "warm"}


def test_idle_ttl_takes_seconds_or_a_timedelta_and_expires_idle_models():
    expired = []
    cache = modelcache.Cache(
        capacity_bytes=100,
        idle_ttl=datetime.timedelta(milliseconds=1),
        on_event=lambda e: expired.append(e.key) if e.type == "expired" else None,
    )
    cache.prefetch("a", lambda: Model("a"), 10)
    spin_until(lambda: cache.evict_expired() == 1, "the idle model expires")
    assert expired == ["a"]
    assert cache.stats().expirations == 1


def test_events_and_a_raising_callback_changes_nothing_and_is_counted(monkeypatch):
    seen = []
    cache = modelcache.Cache(capacity_bytes=100, on_event=lambda e: seen.append((e.type, e.key, e.bytes)))
    cache.prefetch("a", lambda: Model("a"), 10)
    with pytest.raises(RuntimeError):
        cache.acquire("b", lambda: (_ for _ in ()).throw(RuntimeError("no")), 10)
    cache.remove("a")
    assert [t for t, _, _ in seen] == ["loaded", "load_failed", "removed"]
    assert seen[0] == ("loaded", "a", 10)

    def raising(event):
        raise RuntimeError("callback bug")

    # The callback's exception is reported like one in __del__ (through
    # sys.unraisablehook) and counted; the acquire is unaffected.
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(u.exc_value))
    quiet = modelcache.Cache(capacity_bytes=100, on_event=raising)
    with quiet.acquire("a", lambda: Model("a"), 10) as m:
        assert m.key == "a"
    assert [str(e) for e in reported] == ["callback bug"]
    s = quiet.stats()
    assert s.callback_errors == 1 and s.loads == 1 and quiet.entry("a").leases == 0


def test_torch_bytes_counts_parameters_buffers_and_shared_storage_once():
    torch = pytest.importorskip("torch")
    linear = torch.nn.Linear(4, 4)  # 16 + 4 float32
    assert modelcache.torch_bytes(linear) == 80
    assert modelcache.torch_bytes(linear.state_dict()) == 80
    bn = torch.nn.BatchNorm1d(8)  # weight, bias, running mean/var, count
    assert modelcache.torch_bytes(bn) == 4 * 8 * 4 + 8
    tied = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False))
    tied.add_module("again", tied[0])
    assert modelcache.torch_bytes(tied) == 64
    with pytest.raises(modelcache.InvalidArgumentError):
        modelcache.torch_bytes(42)


# ---- the C++ suite's concurrency tests, from Python ----


def test_sixteen_threads_on_one_cold_key_construct_it_once_and_all_get_it():
    cache = modelcache.Cache(capacity_bytes=1000)
    constructions = []
    release_loader = threading.Event()
    got = []
    start = threading.Barrier(16)

    def load():
        constructions.append(1)
        assert release_loader.wait(60)
        return Model("k", len(constructions))

    def worker():
        start.wait(60)
        with cache.acquire("k", load, 10) as m:
            got.append(m)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    # Every thread but the loader's is blocked on the load: the GIL was
    # released while they wait, or this thread could not observe it.
    spin_until(lambda: waiters_on(cache, "k") == 15, "15 waiters joined the load")
    release_loader.set()
    for t in threads:
        t.join(60)
    assert len(constructions) == 1
    assert len(got) == 16 and all(m is got[0] for m in got)
    s = cache.stats()
    assert (s.loads, s.misses, s.hits) == (1, 16, 0)


def test_a_failing_loader_gives_the_loader_its_error_and_every_waiter_a_load_error():
    cache = modelcache.Cache(capacity_bytes=1000)
    raised = []
    calls = []
    fail_now = threading.Event()
    results = {}

    def load():
        calls.append(threading.get_ident())
        assert fail_now.wait(60)
        e = ValueError("corrupt weights")
        raised.append(e)
        raise e

    def worker(i):
        try:
            cache.acquire("k", load, 10)
            results[i] = None
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    spin_until(lambda: waiters_on(cache, "k") == 7, "7 waiters joined the load")
    fail_now.set()
    for t in threads:
        t.join(60)
    assert len(calls) == 1 and len(raised) == 1
    loader_thread_errors = [e for e in results.values() if e is raised[0]]
    waiter_errors = [e for e in results.values() if e is not raised[0]]
    assert len(loader_thread_errors) == 1  # unchanged, the very object
    assert len(waiter_errors) == 7
    for e in waiter_errors:
        assert isinstance(e, modelcache.LoadError) and isinstance(e, modelcache.Error)
        assert e.__cause__ is raised[0]
        assert "corrupt weights" in str(e)
    # Not cached: the next acquire loads again.
    fail_now.clear()
    with cache.acquire("k", lambda: Model("k"), 10) as m:
        assert m.key == "k"
    assert cache.stats().load_failures == 1 and cache.stats().loads == 1


def test_a_model_in_use_is_never_unloaded():
    cache = modelcache.Cache(capacity_bytes=100, shard_bits=2)
    in_use = {}
    lock = threading.Lock()
    violations = []

    def loader(key):
        def load():
            def unload():
                with lock:
                    if in_use.get(key, 0) != 0:
                        violations.append(key)

            return modelcache.Loaded(Model(key), 30, unload=unload)

        return load

    start = threading.Barrier(8)

    def worker(seed):
        start.wait(60)
        for i in range(300):
            key = "m%d" % ((seed * 7 + i * 3) % 6)
            with cache.acquire(key, loader(key), 30, when_full="wait", timeout=60) as m:
                with lock:
                    in_use[key] = in_use.get(key, 0) + 1
                assert m.key == key
                with lock:
                    in_use[key] -= 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert violations == []
    s = cache.stats()
    assert s.evictions > 0
    assert s.high_water_bytes <= 100
    assert cache.check_invariants() == cache.budget.used


def test_two_caches_on_one_budget_evict_from_each_other():
    budget = modelcache.Budget(100, name="host")
    checkpoints = modelcache.Cache(name="checkpoints", budget=budget)
    loras = modelcache.Cache(name="loras", budget=budget)
    checkpoints.prefetch("sdxl", lambda: Model("sdxl"), 70)
    with loras.acquire("style", lambda: Model("style"), 50) as m:
        assert m.key == "style"
    assert checkpoints.entry("sdxl") is None  # evicted for the LoRA
    assert checkpoints.stats().evictions == 1
    checkpoints.prefetch("sdxl", lambda: Model("sdxl"), 70)
    assert loras.entry("style") is None
    assert budget.used == 70 and budget.high_water <= 100
    assert checkpoints.budget is budget or checkpoints.budget.name == "host"


def test_destroying_a_cache_returns_its_bytes_and_unloads_its_models():
    budget = modelcache.Budget(100)
    unloaded = []
    cache = modelcache.Cache(budget=budget)
    cache.prefetch("a", lambda: modelcache.Loaded(Model("a"), 30, unload=lambda: unloaded.append("a")), 30)
    value_gone = []
    with cache.acquire("b", lambda: Model("b"), 20) as b:
        weakref.finalize(b, value_gone.append, "b")
        del b
    assert budget.used == 50
    del cache
    gc.collect()
    assert budget.used == 0
    assert unloaded == ["a"]
    assert value_gone == ["b"]


def test_a_lease_keeps_its_cache_alive():
    budget = modelcache.Budget(100)
    cache = modelcache.Cache(budget=budget)
    lease = cache.acquire("a", lambda: Model("a"), 30)
    del cache
    gc.collect()
    assert budget.used == 30 and lease.value.key == "a"
    lease.release()
    del lease
    gc.collect()
    assert budget.used == 0


# ---- threads and the GIL ----


def test_loads_of_two_keys_run_in_parallel():
    cache = modelcache.Cache(capacity_bytes=100)
    both_loading = threading.Barrier(2)

    def loader(key):
        def load():
            # Passes only if the other thread's loader runs at the same
            # time: neither acquire holds the GIL or a cache lock meanwhile.
            both_loading.wait(30)
            return Model(key)

        return load

    results = []
    threads = [
        threading.Thread(target=lambda k=k: results.append(cache.acquire(k, loader(k), 10).value.key))
        for k in ("a", "b")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == ["a", "b"]
    assert not both_loading.broken


def test_waiting_for_capacity_releases_the_gil():
    cache = modelcache.Cache(capacity_bytes=100)
    held = cache.acquire("a", lambda: Model("a"), 80)
    got = []
    t = threading.Thread(
        target=lambda: got.append(cache.acquire("b", lambda: Model("b"), 50, when_full="wait", timeout=60).value)
    )
    t.start()
    # This thread runs while the other waits for room, then makes the room.
    spin_until(lambda: cache.budget.waiters == 1, "the acquire waits for room")
    held.release()
    t.join(60)
    assert [m.key for m in got] == ["b"]
    assert cache.entry("a") is None


def test_a_loader_may_acquire_another_key_but_not_its_own():
    cache = modelcache.Cache(capacity_bytes=100)

    def load_pipeline():
        with cache.acquire("encoder", lambda: Model("encoder"), 10) as enc:
            return Model("pipeline:" + enc.key)

    with cache.acquire("pipeline", load_pipeline, 20) as p:
        assert p.key == "pipeline:encoder"

    def load_self():
        return cache.acquire("self", lambda: Model("inner"), 10)

    with pytest.raises(modelcache.FailedPreconditionError, match="own loader"):
        cache.acquire("self", load_self, 10)
    assert cache.entry("self") is None
    cache.add_alias("me", "self2")

    def load_through_alias():
        return cache.acquire("me", lambda: Model("inner"), 10)

    with pytest.raises(modelcache.FailedPreconditionError):
        cache.acquire("self2", load_through_alias, 10)
    assert cache.check_invariants() == cache.budget.used == 30


def test_values_are_released_with_the_gil_on_the_thread_that_drops_them():
    cache = modelcache.Cache(capacity_bytes=100)
    cache.prefetch("a", lambda: Model("a"), 60)
    with cache.acquire("a", lambda: Model("a"), 60) as m:
        ref = weakref.ref(m)
        del m
    freed_on = []
    weakref.finalize(ref(), lambda: freed_on.append(threading.get_ident()))
    # Another thread's acquire evicts it: the value is dropped there.
    t = threading.Thread(target=lambda: cache.acquire("b", lambda: Model("b"), 60).release())
    t.start()
    t.join(60)
    assert ref() is None
    assert freed_on == [t.ident]


def test_keyboard_interrupt_ends_a_wait_for_another_load():
    cache = modelcache.Cache(capacity_bytes=100)
    finish = threading.Event()
    loaded = []
    loader_thread = threading.Thread(
        target=lambda: loaded.append(cache.acquire("k", lambda: (finish.wait(60), Model("k"))[1], 10).value)
    )
    loader_thread.start()
    spin_until(lambda: cache.entry("k") is not None, "the load started")

    def interrupt_when_blocked():
        spin_until(lambda: waiters_on(cache, "k") == 1, "the main thread waits for the load")
        _thread.interrupt_main()

    interrupter = threading.Thread(target=interrupt_when_blocked)
    interrupter.start()
    with pytest.raises(KeyboardInterrupt):
        cache.acquire("k", lambda: Model("never"), 10)
    interrupter.join(60)
    assert waiters_on(cache, "k") == 0
    finish.set()
    loader_thread.join(60)
    assert [m.key for m in loaded] == ["k"]
    assert cache.stats().loads == 1


def test_keyboard_interrupt_ends_a_wait_for_capacity_and_reserves_nothing():
    cache = modelcache.Cache(capacity_bytes=100)
    held = cache.acquire("a", lambda: Model("a"), 80)

    def interrupt_when_blocked():
        spin_until(lambda: cache.budget.waiters == 1, "the main thread waits for room")
        _thread.interrupt_main()

    interrupter = threading.Thread(target=interrupt_when_blocked)
    interrupter.start()
    with pytest.raises(KeyboardInterrupt):
        cache.acquire("b", lambda: Model("b"), 50, when_full="wait")
    interrupter.join(60)
    assert cache.budget.used == 80 and cache.budget.waiters == 0
    assert cache.entry("b") is None
    held.release()
    assert cache.check_invariants() == 80
