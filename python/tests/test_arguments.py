"""Wrong arguments, as a Python user meets them: every public function
called with a wrong type in each of its parameters raises TypeError or
InvalidArgumentError naming that parameter, never pybind11's list of
overloads; byte sizes take an int or the CLI's strings ("16GiB", "500MB");
negative, zero and malformed sizes are InvalidArgumentError naming the
argument; and acquire without expected_bytes says what it is for.

The sweep's table is checked against the package's public API, so a public
function added without a row fails here.
"""

from __future__ import annotations

import datetime
import inspect
import json
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest

import modelcache
import modelcache.runtime
import modelcache.serve
import modelcache.weights
from modelcache import InvalidArgumentError
from serve_util import Daemon, random_model, write_catalog, write_safetensors


class Wrong:
    """A value no parameter accepts."""

    def __repr__(self) -> str:
        return "<Wrong>"


WRONG = Wrong()


def parameter_names(fn: Callable) -> List[str]:
    """The parameters of `fn` (self left out): from inspect.signature, or,
    for a pybind11 function, from the signature line of its docstring."""
    try:
        sig = inspect.signature(fn)
        return [p.name for p in sig.parameters.values()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"]
    except (ValueError, TypeError):
        pass
    doc = (fn.__init__ if inspect.isclass(fn) else fn).__doc__ or ""
    line = doc.splitlines()[0] if doc else ""
    assert "(" in line, f"{fn!r} has no signature to read"
    inside = line[line.index("(") + 1:line.rindex(")")]
    names = []
    for part in inside.split(", "):
        name = part.split(":")[0].split("=")[0].strip()
        if name and name not in ("self", "*", "/"):
            names.append(name)
    return names


def check_wrong(fn: Callable, valid: Dict[str, Any], skip: Tuple[str, ...] = ()) -> None:
    names = [n for n in parameter_names(fn) if n not in skip]
    assert set(names) <= set(valid), (fn, names, valid)
    for name in names:
        args = dict(valid, **{name: WRONG})
        with pytest.raises((TypeError, InvalidArgumentError)) as info:
            fn(**args)
        text = str(info.value)
        assert name in text, (fn, name, text)
        assert "incompatible function arguments" not in text, (fn, name, text)
        assert "At:" not in text and "\n" not in text, (fn, name, text)


@pytest.fixture
def weights_file(tmp_path: Path) -> Path:
    path = tmp_path / "w.safetensors"
    write_safetensors(path, random_model(1))
    return path


@pytest.fixture
def registry(tmp_path: Path, weights_file: Path) -> Path:
    path = tmp_path / "models.json"
    path.write_text(json.dumps({"models": [{"id": "m", "files": [weights_file.name]}]}))
    return path


# Every public callable with parameters, by qualified name, and the test
# that sweeps it. Parameters that take any object are listed as skipped.
SWEPT = {
    "modelcache.Cache", "modelcache.Cache.acquire", "modelcache.Cache.prefetch",
    "modelcache.Cache.get", "modelcache.Cache.remove", "modelcache.Cache.invalidate",
    "modelcache.Cache.pin", "modelcache.Cache.unpin", "modelcache.Cache.add_alias",
    "modelcache.Cache.remove_alias", "modelcache.Cache.resolve",
    "modelcache.Cache.set_capacity", "modelcache.Cache.entry",
    "modelcache.Budget", "modelcache.Budget.set_capacity",
    "modelcache.Budget.set_drain_after", "modelcache.Loaded",
    "modelcache.policy_names", "modelcache.torch_bytes",
    "modelcache.weights.inspect", "modelcache.weights.save_file",
    "modelcache.weights.HostWeightStore",
    "modelcache.weights.HostWeightStore.acquire",
    "modelcache.weights.HostWeightStore.invalidate",
    "modelcache.weights.WeightsLease.numpy", "modelcache.weights.WeightsLease.raw",
    "modelcache.weights.WeightsLease.torch", "modelcache.weights.load_state_dict",
    "modelcache.runtime.Runtime", "modelcache.runtime.Runtime.acquire",
    "modelcache.runtime.ModelLease.read", "modelcache.runtime.SimulatedDevice",
    "modelcache.runtime.HostDevice", "modelcache.runtime.CudaDevice",
    "modelcache.serve.connect", "modelcache.serve.Client.acquire",
    "modelcache.serve.Client.acquire_local",
    "modelcache.serve.Client.ping", "modelcache.serve.RemoteLease.numpy",
    "modelcache.serve.RemoteLease.raw", "modelcache.serve.RemoteLease.torch",
}

# Public callables whose parameters are not the user's to get wrong.
NOT_SWEPT_CLASSES = {"CacheStats", "Entry", "Event", "RuntimeStats", "DeviceStats"}


def public_callables() -> List[str]:
    found = []
    for module in (modelcache, modelcache.weights, modelcache.runtime, modelcache.serve):
        for name in module.__all__:
            obj = getattr(module, name)
            qual = f"{module.__name__}.{name}"
            if inspect.ismodule(obj) or name in NOT_SWEPT_CLASSES:
                continue
            if inspect.isclass(obj):
                if issubclass(obj, BaseException):
                    continue
                if obj.__init__ is not object.__init__ and parameter_names(obj.__init__):
                    found.append(qual)
                for attr in dir(obj):
                    if attr.startswith("_") or isinstance(
                            inspect.getattr_static(obj, attr), property):
                        continue
                    member = getattr(obj, attr)
                    if callable(member) and parameter_names(member):
                        found.append(f"{qual}.{attr}")
            elif callable(obj) and parameter_names(obj):
                found.append(qual)
    return sorted(set(found))


def test_the_sweep_covers_every_public_function_with_parameters():
    # Lease, Client and RemoteLease's __init__ are internal (made by the
    # package), not called by users.
    internal = {"modelcache.weights.WeightsLease", "modelcache.runtime.ModelLease",
                "modelcache.serve.RemoteLease", "modelcache.serve.Client"}
    assert set(public_callables()) - internal == SWEPT


def test_cache_budget_and_loaded_name_the_wrong_argument():
    check_wrong(modelcache.Cache, dict(name="c", capacity_bytes=1000, budget=None,
                                       policy="lru", idle_ttl=None, shard_bits=4,
                                       on_event=None, drain_after=None))
    check_wrong(modelcache.Budget, dict(capacity_bytes=100, name="b", drain_after=None))
    check_wrong(modelcache.Budget(100).set_capacity, dict(capacity_bytes=100))
    check_wrong(modelcache.Budget(100).set_drain_after, dict(drain_after=1))
    check_wrong(modelcache.Loaded, dict(value=1, bytes=10, unload=None), skip=("value",))
    check_wrong(modelcache.policy_names, dict(offline=False))
    check_wrong(modelcache.torch_bytes, dict(module_or_state_dict={}))
    cache = modelcache.Cache(capacity_bytes=1000)
    load = dict(key="k", loader=lambda: "v", expected_bytes=10, timeout=None,
                when_full="fail")
    check_wrong(cache.acquire, load)
    check_wrong(cache.prefetch, dict(load, evict_only_lower_ranked=False))
    for method in (cache.get, cache.pin, cache.unpin, cache.resolve, cache.entry):
        check_wrong(method, dict(key="k"))
    for method in (cache.remove, cache.invalidate):
        check_wrong(method, dict(key="k", timeout=None))
    check_wrong(cache.add_alias, dict(alias="x", canonical="k"))
    check_wrong(cache.remove_alias, dict(alias="x"))
    check_wrong(cache.set_capacity, dict(capacity_bytes=1000))
    # Nothing changed: no entry, no alias, the capacity as it was.
    assert cache.entries() == [] and cache.resolve("x") == "x"
    assert cache.budget.capacity == 1000 and cache.stats().loads == 0


def test_weights_functions_name_the_wrong_argument(weights_file: Path):
    weights = modelcache.weights
    check_wrong(weights.inspect, dict(path=weights_file))
    check_wrong(weights.save_file, dict(tensors={"w": np.zeros(2)},
                                        path=weights_file.with_name("s.safetensors"),
                                        metadata={"k": "v"}))
    check_wrong(weights.HostWeightStore, dict(capacity_bytes="1MiB", mode="mmap",
                                              name="h", pread_threads=2))
    store = weights.HostWeightStore("1MiB")
    check_wrong(store.acquire, dict(path=weights_file, timeout=None, when_full="fail"))
    check_wrong(store.invalidate, dict(path=weights_file))
    check_wrong(weights.load_state_dict, dict(store=store, path=weights_file,
                                              timeout=None, when_full="fail"))
    with store.acquire(weights_file) as lease:
        for method in (lease.numpy, lease.raw, lease.torch):
            check_wrong(method, dict(name="weight"))


def test_runtime_functions_name_the_wrong_argument(registry: Path):
    runtime = modelcache.runtime
    sim = runtime.SimulatedDevice("sim", "1MiB")
    check_wrong(runtime.Runtime, dict(registry_json_path=registry,
                                      host_capacity_bytes="1MiB", devices=[sim],
                                      mode="mmap", pread_threads=2))

    # The device records are checked when a runtime is made from them.
    def runtime_with(device_class, **fields):
        return runtime.Runtime(registry, "1MiB", [device_class(**fields)])

    for device_class, valid in ((runtime.SimulatedDevice,
                                 dict(name="s", capacity_bytes="1MiB",
                                      working_reserve_bytes=0,
                                      bandwidth_bytes_per_second=1e9)),
                                (runtime.HostDevice,
                                 dict(name="h", capacity_bytes=0, working_reserve_bytes=0)),
                                (runtime.CudaDevice,
                                 dict(ordinal=0, capacity_bytes=0, working_reserve_bytes=0))):
        assert set(parameter_names(device_class)) == set(valid)
        check_wrong(lambda **f: runtime_with(device_class, **f), valid)
    rt = runtime.Runtime(registry, "1MiB", [sim])
    check_wrong(rt.acquire, dict(model="m", device=0, placement="full", timeout=None,
                                 when_full="fail"))
    with rt.acquire("m") as lease:
        check_wrong(lease.read, dict(name="weight", raw=False))


def test_serve_functions_name_the_wrong_argument(tmp_path: Path, weights_file: Path):
    write_catalog(tmp_path / "catalog.json", [{"id": "m", "files": [weights_file.name]}])
    daemon = Daemon(tmp_path, tmp_path / "catalog.json", tmp_path).start()
    try:
        check_wrong(modelcache.serve.connect, dict(socket_path=daemon.socket,
                                                   connect_timeout=0, keep_idle=60,
                                                   idle_notice_delay=0.001,
                                                   reclaim=True))
        for name in ("keep_idle", "idle_notice_delay"):
            for bad, error in ((None, TypeError), ("1", TypeError), (True, TypeError),
                               (-1, InvalidArgumentError),
                               (float("nan"), InvalidArgumentError),
                               (datetime.timedelta(seconds=-1), InvalidArgumentError)):
                with pytest.raises(error) as info:
                    modelcache.serve.connect(daemon.socket, **{name: bad})
                assert name in str(info.value), (name, bad, info.value)
        with pytest.raises(InvalidArgumentError, match="idle_notice_delay"):
            modelcache.serve.connect(daemon.socket, idle_notice_delay=float("inf"))
        with modelcache.serve.connect(daemon.socket) as client:
            check_wrong(client.acquire, dict(model="m", timeout=30, when_full="wait"))
            check_wrong(client.acquire_local, dict(model="m"))
            check_wrong(client.ping, dict(timeout=5))
            with client.acquire("m", timeout=30) as lease:
                check_wrong(lease.numpy, dict(name="weight"))
                check_wrong(lease.raw, dict(name="weight"))
                check_wrong(lease.torch, dict(name="weight", copy=False))
    finally:
        daemon.stop()


# ---- byte sizes ----


@pytest.mark.parametrize("given, expected", [
    ("16GiB", 16 << 30), ("500MB", 500 * 10**6), ("1.5 GiB", 3 << 29),
    ("4096", 4096), (4096, 4096), (np.int64(4096), 4096)])
def test_byte_sizes_take_an_int_or_the_clis_strings(given, expected):
    assert modelcache.Cache(capacity_bytes=given).budget.capacity == expected
    assert modelcache.Budget(given).capacity == expected
    assert modelcache.weights.HostWeightStore(given).capacity_bytes == expected


@pytest.mark.parametrize("given, says", [
    (-1, "must not be negative"), (0, "more than 0"), ("0GiB", "more than 0"),
    ("-1GiB", "not a byte size"), ("16 gigs", "not a byte size"), ("", "not a byte size"),
    (1 << 64, "2^64"), ("16EiB", "not a byte size")])
def test_bad_byte_sizes_are_invalid_arguments_naming_the_argument(given, says):
    for make in (lambda: modelcache.Cache(capacity_bytes=given),
                 lambda: modelcache.Budget(capacity_bytes=given),
                 lambda: modelcache.weights.HostWeightStore(capacity_bytes=given)):
        with pytest.raises(InvalidArgumentError, match="capacity_bytes") as info:
            make()
        assert says in str(info.value)


def test_byte_sizes_refuse_other_types_with_a_type_error():
    for given in (1.5, True, [1], None):
        with pytest.raises(TypeError, match=re.escape(
                f"capacity_bytes must be an int or a byte size string such as "
                f"'16GiB' or '500MB', not {type(given).__name__}")):
            modelcache.Budget(given)


def test_expected_bytes_is_required_and_says_why():
    cache = modelcache.Cache(capacity_bytes="1MiB")
    for call in (lambda: cache.acquire("k", lambda: "v"),
                 lambda: cache.acquire("k", lambda: "v", timeout=1),
                 lambda: cache.prefetch("k", lambda: "v")):
        with pytest.raises(TypeError, match="missing required argument 'expected_bytes'") as info:
            call()
        assert "reserve" in str(info.value)
    with pytest.raises(TypeError, match="missing required argument 'loader'"):
        cache.acquire("k")
    # Zero is allowed (the loader's Loaded gives the real size), as is a string.
    with cache.acquire("k", lambda: modelcache.Loaded("v", 100), 0) as v:
        assert v == "v"
    with cache.acquire("j", lambda: "w", "2KiB") as lease_value:
        assert lease_value == "w"
    assert cache.entry("j").bytes == 2048 and cache.entry("k").bytes == 100
    with pytest.raises(InvalidArgumentError, match="expected_bytes"):
        cache.acquire("n", lambda: "v", -5)
    assert cache.entry("n") is None
    # On a hit too: the size is checked whether or not the loader would run.
    for bad in (-5, True):
        with pytest.raises((InvalidArgumentError, TypeError), match="expected_bytes"):
            cache.acquire("j", lambda: "w", bad)
    assert cache.entry("j").leases == 0
