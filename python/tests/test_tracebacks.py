"""A user callback's exception keeps its traceback wherever it surfaces.

The thread that ran a loader gets the loader's own exception, and its
traceback runs from the acquire down to the raise; every thread that waited
for that load gets LoadError whose __cause__ is that exception, traceback
included. Unloaders' exceptions reach remove() the same way, and an
on_event callback's reaches sys.unraisablehook with its frames. Messages
read like Python's (no pybind11 "At:" dump of the frames).

The tests check the frames by name (traceback.extract_tb).
"""

from __future__ import annotations

import sys
import threading
import traceback
from pathlib import Path
from typing import List

import pytest

import modelcache
import modelcache.runtime
import modelcache.weights
from conftest import spin_until


def frames(error: BaseException) -> List[str]:
    return [f.name for f in traceback.extract_tb(error.__traceback__)]


def deepest_raise() -> None:
    raise ValueError("disk on fire")


def middle() -> None:
    deepest_raise()


def failing_loader():
    middle()


def assert_clean_message(text: str) -> None:
    assert "At:" not in text and "\n" not in text, text
    assert "pybind11" not in text and "error_already_set" not in text, text


def test_the_loader_thread_gets_every_frame_from_the_acquire_down_to_the_raise():
    cache = modelcache.Cache(capacity_bytes=1 << 20)
    with pytest.raises(ValueError) as info:
        cache.acquire("k", failing_loader, 10)
    assert frames(info.value) == [
        "test_the_loader_thread_gets_every_frame_from_the_acquire_down_to_the_raise",
        "failing_loader", "middle", "deepest_raise"]
    assert str(info.value) == "disk on fire"
    formatted = "".join(traceback.format_exception(info.value))
    assert "in deepest_raise" in formatted and 'raise ValueError("disk on fire")' in formatted


def test_keyword_calls_and_prefetch_keep_the_frames_too():
    cache = modelcache.Cache(capacity_bytes=1 << 20)
    with pytest.raises(ValueError) as info:
        cache.acquire("k", failing_loader, expected_bytes="1KiB", timeout=5)
    assert frames(info.value)[1:] == ["failing_loader", "middle", "deepest_raise"]
    with pytest.raises(ValueError) as info:
        cache.prefetch("k", failing_loader, 10)
    assert frames(info.value)[1:] == ["failing_loader", "middle", "deepest_raise"]


def test_a_loader_failing_inside_a_nested_acquire_keeps_both_loaders_frames():
    cache = modelcache.Cache(capacity_bytes=1 << 20)

    def outer_loader():
        with cache.acquire("inner", failing_loader, 10):
            pass

    with pytest.raises(ValueError) as info:
        cache.acquire("outer", outer_loader, 10)
    assert frames(info.value)[1:] == [
        "outer_loader", "failing_loader", "middle", "deepest_raise"]


def test_waiters_get_a_load_error_caused_by_the_loaders_exception_with_its_frames():
    cache = modelcache.Cache(capacity_bytes=1 << 20)
    fail_now = threading.Event()
    results = {}

    def blocking_loader():
        assert fail_now.wait(60)
        middle()

    def worker(i: int) -> None:
        try:
            cache.acquire("k", blocking_loader, 10)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    spin_until(lambda: (cache.entry("k") is not None and
                        cache.entry("k").waiters == 2), "2 waiters joined the load")
    fail_now.set()
    for t in threads:
        t.join(60)
    loader_errors = [e for e in results.values() if isinstance(e, ValueError)]
    waiter_errors = [e for e in results.values() if isinstance(e, modelcache.LoadError)]
    assert len(loader_errors) == 1 and len(waiter_errors) == 2
    original = loader_errors[0]
    assert frames(original) == ["worker", "blocking_loader", "middle", "deepest_raise"]
    for e in waiter_errors:
        assert e.__cause__ is original
        # The cause's traceback holds the loader's frames (and, once the
        # loader's thread unwound, that thread's acquire too).
        assert frames(e.__cause__)[-3:] == ["blocking_loader", "middle", "deepest_raise"]
        assert frames(e) == ["worker"]
        assert str(e) == ("loading 'k' in cache 'models' failed in another thread: "
                          "ValueError: disk on fire")
        assert_clean_message(str(e))
        formatted = "".join(traceback.format_exception(e))
        assert "direct cause" in formatted and "in deepest_raise" in formatted


def test_an_unloaders_exception_reaches_remove_with_its_frames_and_events_read_cleanly():
    events = []
    cache = modelcache.Cache(capacity_bytes=1 << 20, on_event=events.append)

    def unload():
        middle()

    cache.prefetch("a", lambda: modelcache.Loaded("value", 10, unload), 10)
    with pytest.raises(ValueError) as info:
        cache.remove("a")
    assert frames(info.value) == [
        "test_an_unloaders_exception_reaches_remove_with_its_frames_and_events_read_cleanly",
        "unload", "middle", "deepest_raise"]
    # Where nothing raises to a caller (prune, eviction), the event says
    # why and holds the exception itself, traceback included.
    del events[:]
    assert cache.prune() == 0
    with pytest.raises(ValueError) as loader_error:
        cache.acquire("b", failing_loader, 10)
    failures = [e for e in events if e.error]
    assert [(e.type, e.key, e.error) for e in failures] == [
        ("unload_failed", "a", "ValueError: disk on fire"),
        ("load_failed", "b", "ValueError: disk on fire")]
    unload_failed, load_failed = failures
    assert isinstance(unload_failed.exception, ValueError)
    assert frames(unload_failed.exception) == ["unload", "middle", "deepest_raise"]
    assert load_failed.exception is loader_error.value
    assert frames(load_failed.exception)[-3:] == ["failing_loader", "middle", "deepest_raise"]
    assert all(e.exception is None for e in events if not e.error)


def test_an_unloader_failing_in_an_eviction_reaches_the_event_with_its_frames():
    events = []
    cache = modelcache.Cache(capacity_bytes=10, on_event=events.append)

    def unload():
        middle()

    cache.prefetch("a", lambda: modelcache.Loaded("value", 10, unload), 10)
    # Making room for "b" runs a's unloader, which raises: a stays.
    with pytest.raises(modelcache.CapacityError):
        cache.acquire("b", lambda: "other", 10)
    failed = [e for e in events if e.type == "unload_failed"]
    assert len(failed) == 1 and failed[0].key == "a"
    assert failed[0].error == "ValueError: disk on fire"
    assert frames(failed[0].exception) == ["unload", "middle", "deepest_raise"]
    assert cache.entry("a").state == "resident"



def test_an_on_event_callbacks_exception_reaches_unraisablehook_with_its_frames(monkeypatch):
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)

    def on_event(event):
        middle()

    cache = modelcache.Cache(capacity_bytes=1 << 20, on_event=on_event)
    with cache.acquire("a", lambda: "value", 10) as value:
        assert value == "value"
    assert len(reported) == 1
    u = reported[0]
    assert isinstance(u.exc_value, ValueError) and u.object is on_event
    assert [f.name for f in traceback.extract_tb(u.exc_traceback)] == [
        "on_event", "middle", "deepest_raise"]
    assert cache.stats().callback_errors == 1


def test_weights_and_runtime_errors_keep_the_callers_frames_and_read_cleanly(tmp_path: Path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x64\x00\x00\x00\x00\x00\x00\x00{}")  # header runs past the end

    def caller():
        store.acquire(bad)

    store = modelcache.weights.HostWeightStore(capacity_bytes="1MiB")
    with pytest.raises(modelcache.InvalidDataError) as info:
        caller()
    assert frames(info.value)[1:] == ["caller", "acquire"]
    assert_clean_message(str(info.value))
    with pytest.raises(modelcache.InvalidDataError) as info:
        modelcache.weights.inspect(bad)
    assert frames(info.value)[-1] == "inspect"
    assert_clean_message(str(info.value))

    registry = tmp_path / "registry.json"
    registry.write_text('{"models": []}')
    rt = modelcache.runtime.Runtime(registry, "1MiB", [
        modelcache.runtime.SimulatedDevice("sim", "1MiB")])

    def place():
        rt.acquire("nobody")

    with pytest.raises(modelcache.NotFoundError) as info:
        place()
    assert frames(info.value)[1:] == ["place", "acquire"]
    assert_clean_message(str(info.value))
