"""Swap scheduling from Python: an acquire waiting for room that a model in
continuous use holds is served once that model drains (``drain_after``),
and the model's own requests go on after it.

Written from the docstrings of Cache and Budget.
"""

from __future__ import annotations

import math
import threading
import time

import pytest

import modelcache
from conftest import spin_until


class Model:
    def __init__(self, key: str) -> None:
        self.key = key


def test_a_model_in_continuous_use_gives_way_to_a_waiting_acquire():
    # Room for one model; A's requests overlap, so A is never idle.
    cache = modelcache.Cache(capacity_bytes=1000, drain_after=0.05)
    lease = cache.acquire("A", lambda: Model("A"), 1000)
    served_b = []
    waiter = threading.Thread(
        target=lambda: served_b.append(
            cache.acquire("B", lambda: Model("B"), 1000, when_full="wait", timeout=60).value.key
        )
    )
    waiter.start()
    spin_until(lambda: cache.budget.waiters == 1, "B waits for room")

    # A's requests overtake B, each taking its lease before the last one
    # ends, until B has waited drain_after: then A takes no new lease.
    served_a = 0
    give_up = time.monotonic() + 60
    while (following := cache.get("A")) is not None:
        assert time.monotonic() < give_up, "A never drained"
        lease.release()
        lease = following
        served_a += 1
    assert cache.budget.drains == 1

    # A request for A now queues behind the drain, holding no lease.
    served_a_later = []
    queued = threading.Thread(
        target=lambda: served_a_later.append(
            cache.acquire("A", lambda: Model("A"), 1000, when_full="wait", timeout=60).value.key
        )
    )
    queued.start()
    spin_until(lambda: cache.budget.queued_behind_drain == 1, "A's request queues")
    assert cache.entry("A").leases == 1
    assert cache.entry("A").draining
    assert "'B'" in cache.entry("A").drain_for

    # The lease out ends: B is served, then A's request goes on.
    lease.release()
    waiter.join(60)
    assert served_b == ["B"]
    queued.join(60)
    assert served_a_later == ["A"]
    assert cache.check_invariants() == cache.budget.used


def test_drain_after_settings():
    assert modelcache.Cache(capacity_bytes=10, drain_after=math.inf).budget.drain_after == math.inf
    assert modelcache.Cache(capacity_bytes=10, drain_after=0).budget.drain_after == 0
    # The default adapts to each waiter's load time: it has no one value.
    assert modelcache.Cache(capacity_bytes=10).budget.drain_after is None
    assert modelcache.Cache(capacity_bytes=10, drain_after=None).budget.drain_after is None
    budget = modelcache.Budget(10, drain_after=1.5)
    assert budget.drain_after == 1.5
    budget.set_drain_after(math.inf)
    assert budget.drain_after == math.inf
    budget.set_drain_after(None)
    assert budget.drain_after is None
    with pytest.raises(modelcache.InvalidArgumentError, match="drain_after"):
        modelcache.Cache(budget=budget, drain_after=1)
    with pytest.raises(modelcache.InvalidArgumentError, match="drain_after"):
        modelcache.Cache(capacity_bytes=10, drain_after=-1)
