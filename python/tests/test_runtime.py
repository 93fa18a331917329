"""modelcache.runtime: models from a registry placed on (simulated) devices
over one shared host store.

Written from the contract in modelcache/runtime.py. Model files are written
by hand (struct + json) into tmp_path, and the values read back from the
devices are compared with the arrays written.
"""

from __future__ import annotations

import gc
import json
import threading
import weakref
from pathlib import Path
from typing import Dict, List

import pytest

np = pytest.importorskip("numpy")

from modelcache import errors  # noqa: E402
from modelcache.runtime import (  # noqa: E402
    CudaDevice,
    ModelLease,
    Runtime,
    SimulatedDevice,
    cuda_available,
    cuda_unavailable_reason,
)
from modelcache.weights import save_file  # noqa: E402

KIB = 1024


def write_model(path: Path, tensors: Dict[str, "np.ndarray"]) -> Path:
    """A safetensors file of the arrays, with the package's writer."""
    save_file(tensors, path)
    return path


def model_arrays(seed: int, kib: int) -> Dict[str, "np.ndarray"]:
    """Three tensors of about `kib` KiB in all, by decreasing size."""
    rng = np.random.default_rng(seed)
    n = kib * KIB // 4
    return {
        "embed": rng.standard_normal(n // 2).astype("<f4"),
        "layer.weight": rng.standard_normal((n // 8, 2)).astype("<f4"),
        "layer.bias": rng.integers(-9, 9, n // 4, dtype="<i4"),
    }


def nbytes(arrays: Dict[str, "np.ndarray"]) -> int:
    return sum(a.nbytes for a in arrays.values())


@pytest.fixture
def models(tmp_path):
    """Registry of models "a" (alias "latest"), "b" and "c" of 64 KiB each,
    and "tiny" of 4 KiB; returns (registry path, name -> arrays)."""
    arrays = {"a": model_arrays(1, 64), "b": model_arrays(2, 64),
              "c": model_arrays(3, 64), "tiny": model_arrays(4, 4)}
    for name, tensors in arrays.items():
        write_model(tmp_path / f"{name}.safetensors", tensors)
    registry = tmp_path / "models.json"
    registry.write_text(json.dumps({"models": [
        {"id": "a", "files": ["a.safetensors"], "aliases": ["latest"]},
        {"id": "b", "files": ["b.safetensors"]},
        {"id": "c", "files": ["c.safetensors"]},
        {"id": "tiny", "files": ["tiny.safetensors"]},
    ]}))
    return registry, arrays


def collect() -> None:
    gc.collect()
    gc.collect()


def check_values(lease: ModelLease, arrays: Dict[str, "np.ndarray"]) -> None:
    for name, want in arrays.items():
        got = lease.read(name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want)


def test_two_devices_share_one_host_copy(models):
    registry, arrays = models
    rt = Runtime(registry, host_capacity_bytes=1 << 20,
                 devices=[SimulatedDevice("sim0", 256 * KIB),
                          SimulatedDevice("sim1", 256 * KIB)])
    assert rt.device_names == ["sim0", "sim1"]
    size = nbytes(arrays["a"])
    with rt.acquire("a", "sim0") as on0, rt.acquire("a", 1) as on1:
        for lease, device in ((on0, "sim0"), (on1, "sim1")):
            assert lease.model == "a"
            assert lease.device == device
            assert lease.full
            assert lease.bytes_on_device == lease.total_bytes == size
            check_values(lease, arrays["a"])
        stats = rt.stats()
        # The file was read once and its host bytes are counted once...
        assert stats.host.loads == 1
        assert stats.host.resident_entries == 1
        assert stats.host.resident_bytes == size
        assert stats.host.budget_used_bytes == size
        # ...while each device holds its own placed copy.
        for device in ("sim0", "sim1"):
            assert stats.devices[device].loads == 1
            assert stats.devices[device].resident_bytes == size
            assert stats.memory[device].bytes_allocated == size
            assert stats.memory[device].bytes_copied_to_device == size
            assert stats.memory[device].simulated_transfer_seconds > 0
            assert stats.memory[device].allocation_granularity == 1
            assert not stats.memory[device].unusable
            assert stats.memory[device].unusable_reason == ""


def test_concurrent_acquires_on_two_devices_read_the_file_once(models):
    registry, arrays = models
    rt = Runtime(registry, 1 << 20, [SimulatedDevice("sim0", 256 * KIB),
                                     SimulatedDevice("sim1", 256 * KIB)])
    per_device = 4
    barrier = threading.Barrier(2 * per_device)
    leases: List[ModelLease] = []
    failures: List[BaseException] = []
    lock = threading.Lock()

    def worker(device):
        try:
            barrier.wait()
            lease = rt.acquire("latest", device)
            with lock:
                leases.append(lease)
        except BaseException as e:
            failures.append(e)

    workers = [threading.Thread(target=worker, args=(d,))
               for d in ("sim0", "sim1") for _ in range(per_device)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not failures
    stats = rt.stats()
    assert stats.host.loads == 1
    assert stats.host.resident_bytes == nbytes(arrays["a"])
    assert stats.devices["sim0"].loads == stats.devices["sim1"].loads == 1
    assert sorted(lease.device for lease in leases) == ["sim0"] * 4 + ["sim1"] * 4
    for lease in leases:
        lease.release()


def test_an_alias_resolves_to_the_model_id(models):
    registry, arrays = models
    rt = Runtime(registry, 1 << 20, [SimulatedDevice("sim0", 256 * KIB)])
    assert sorted(rt.models) == ["a", "b", "c", "tiny"]
    with rt.acquire("latest") as x, rt.acquire("a") as y:
        assert x.model == y.model == "a"
    assert rt.stats().devices["sim0"].loads == 1


def test_partial_placement_leaves_what_does_not_fit_on_the_host(models):
    registry, arrays = models
    size = nbytes(arrays["a"])
    embed = arrays["a"]["embed"].nbytes
    # Room for the first tensor (half the model) and a bit, not the rest.
    rt = Runtime(registry, 1 << 20, [SimulatedDevice("sim0", embed + 4 * KIB)])
    with pytest.raises(errors.TooLargeError):
        rt.acquire("a", placement="full")
    with rt.acquire("a", placement="partial") as lease:
        assert not lease.full
        assert lease.total_bytes == size
        placed = {t["name"]: t for t in lease.tensors()}
        assert list(placed) == ["embed", "layer.weight", "layer.bias"]
        assert placed["embed"]["on_device"] and placed["embed"]["device_offset"] == 0
        assert not placed["layer.weight"]["on_device"]
        assert placed["layer.weight"]["device_offset"] is None
        on_device = sum(t["bytes"] for t in placed.values() if t["on_device"])
        assert lease.bytes_on_device == on_device == embed
        assert rt.stats().memory["sim0"].bytes_allocated == embed
        # Both kinds read back equal to what was written.
        check_values(lease, arrays["a"])
        raw = lease.read("layer.bias", raw=True)
        assert raw.dtype == np.uint8 and raw.tobytes() == arrays["a"]["layer.bias"].tobytes()


def test_a_device_full_of_leased_models_fails_then_evicts_once_released(models):
    registry, arrays = models
    size = nbytes(arrays["a"])
    rt = Runtime(registry, 1 << 20, [SimulatedDevice("sim0", size + size // 2)])
    lease_a = rt.acquire("a")
    with pytest.raises(errors.CapacityError):
        rt.acquire("b")
    with pytest.raises(errors.TimeoutError):
        rt.acquire("b", when_full="wait", timeout=0.05)
    check_values(lease_a, arrays["a"])  # untouched by the failures
    lease_a.release()
    with rt.acquire("b") as lease_b:
        check_values(lease_b, arrays["b"])
    stats = rt.stats()
    assert stats.devices["sim0"].evictions == 1
    assert stats.memory["sim0"].bytes_allocated == nbytes(arrays["b"])
    # The host keeps both files (neither pushed out), counted once each.
    assert stats.host.resident_bytes == 2 * size


def test_a_placed_model_keeps_its_host_copy_from_eviction(models):
    registry, arrays = models
    size = nbytes(arrays["a"])
    file_size = (registry.parent / "a.safetensors").stat().st_size
    # The host has room for one file (and a load's reservation), not two.
    rt = Runtime(registry, file_size * 3 // 2,
                 [SimulatedDevice("sim0", 4 * size), SimulatedDevice("sim1", 4 * size)])
    rt.acquire("a", "sim0").release()  # placed on sim0, unleased
    # "a" stays on sim0, which holds its host copy: "b" finds no host room.
    with pytest.raises(errors.CapacityError):
        rt.acquire("b", "sim1")
    assert rt.stats().host.resident_bytes == size
    # Once "a" leaves the device, its host copy can go.
    assert rt.prune() == 2  # a on sim0, then a's host copy
    with rt.acquire("b", "sim1") as lease:
        check_values(lease, arrays["b"])
    assert rt.stats().host.loads == 2


def test_unknown_models_and_bad_devices_are_clear_errors(models):
    registry, _ = models
    rt = Runtime(registry, 1 << 20, [SimulatedDevice("sim0", 256 * KIB)])
    with pytest.raises(errors.NotFoundError, match="nope") as info:
        rt.acquire("nope")
    assert isinstance(info.value, KeyError)
    with pytest.raises(errors.InvalidArgumentError, match="out of range"):
        rt.acquire("a", 1)
    with pytest.raises(errors.InvalidArgumentError):
        rt.acquire("a", -1)
    with pytest.raises(errors.NotFoundError, match="sim9"):
        rt.acquire("a", "sim9")
    with pytest.raises(errors.InvalidArgumentError, match="placement"):
        rt.acquire("a", placement="most")
    with pytest.raises(errors.InvalidArgumentError, match="when_full"):
        rt.acquire("a", when_full="later")
    stats = rt.stats()
    assert stats.host.misses == 0 and stats.devices["sim0"].misses == 0


def test_bad_device_specs_are_invalid_arguments(models):
    registry, _ = models
    with pytest.raises(errors.InvalidArgumentError, match="two devices"):
        Runtime(registry, 1 << 20, [SimulatedDevice("x", KIB), SimulatedDevice("x", KIB)])
    with pytest.raises(errors.InvalidArgumentError, match="kind"):
        Runtime(registry, 1 << 20, [{"kind": "tpu", "name": "t"}])
    with pytest.raises(errors.InvalidArgumentError, match="unknown keys"):
        Runtime(registry, 1 << 20, [{"kind": "simulated", "name": "s",
                                     "capacity_bytes": KIB, "colour": 1}])
    with pytest.raises(errors.InvalidArgumentError):
        Runtime(registry, 1 << 20, [SimulatedDevice("s", 0)])
    with pytest.raises(errors.InvalidArgumentError):
        Runtime(registry, 0, [])
    with pytest.raises(errors.InvalidArgumentError, match="mode"):
        Runtime(registry, 1 << 20, [], mode="direct")


def test_device_dicts_work_like_device_objects(models):
    registry, arrays = models
    rt = Runtime(registry, 1 << 20, [
        {"kind": "simulated", "name": "d0", "capacity_bytes": 256 * KIB},
        {"kind": "host", "name": "cpu", "capacity_bytes": 256 * KIB},
    ], mode="pread")
    with rt.acquire("tiny", "d0") as x, rt.acquire("tiny", "cpu") as y:
        check_values(x, arrays["tiny"])
        check_values(y, arrays["tiny"])
    assert rt.stats().host.loads == 1


def test_a_working_reserve_is_kept_free_of_models(models):
    registry, arrays = models
    size = nbytes(arrays["a"])
    rt = Runtime(registry, 1 << 20,
                 [SimulatedDevice("sim0", size + 8 * KIB, working_reserve_bytes=16 * KIB)])
    with pytest.raises(errors.TooLargeError):
        rt.acquire("a")
    with rt.acquire("tiny") as lease:
        assert lease.full


def test_bad_registries_are_invalid_data_naming_the_problem(tmp_path):
    registry = tmp_path / "models.json"
    registry.write_text('{"models": [{"id": "a", "files": ["x"], "colour": 1}]}')
    with pytest.raises(errors.InvalidDataError, match="colour"):
        Runtime(registry, 1 << 20, [SimulatedDevice("sim0", KIB)])
    registry.write_text('{"models": [')
    with pytest.raises(errors.InvalidDataError, match="JSON"):
        Runtime(registry, 1 << 20, [SimulatedDevice("sim0", KIB)])
    with pytest.raises(errors.Error):
        Runtime(tmp_path / "missing.json", 1 << 20, [SimulatedDevice("sim0", KIB)])


def test_a_missing_or_bad_weight_file_changes_no_books(tmp_path):
    write_model(tmp_path / "ok.safetensors", {"w": np.arange(256, dtype="<f4")})
    (tmp_path / "bad.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"{}")
    registry = tmp_path / "models.json"
    registry.write_text(json.dumps({"models": [
        {"id": "ok", "files": ["ok.safetensors"]},
        {"id": "gone", "files": ["missing.safetensors"]},
        {"id": "bad", "files": ["bad.safetensors"]},
        {"id": "mixed", "files": ["ok.safetensors", "bad.safetensors"]},
    ]}))
    rt = Runtime(registry, 1 << 20, [SimulatedDevice("sim0", 64 * KIB)])
    with pytest.raises(errors.IoError) as info:
        rt.acquire("gone")
    assert "missing.safetensors" in str(info.value)
    with pytest.raises(errors.InvalidDataError, match="bad.safetensors"):
        rt.acquire("bad")
    with pytest.raises(errors.InvalidDataError):
        rt.acquire("mixed")
    stats = rt.stats()
    assert stats.memory["sim0"].bytes_allocated == 0
    assert stats.devices["sim0"].resident_entries == 0
    # "ok" was read for "mixed" and is resident but unreferenced.
    assert rt.prune() == 1
    assert rt.stats().host.budget_used_bytes == 0


def test_release_is_idempotent_and_a_released_lease_reads_nothing(models):
    registry, arrays = models
    rt = Runtime(registry, 1 << 20, [SimulatedDevice("sim0", 256 * KIB)])
    with rt.acquire("a") as lease:
        assert isinstance(lease, ModelLease)
    assert lease.released
    lease.release()
    assert lease.model == "a" and lease.full  # still readable
    with pytest.raises(errors.FailedPreconditionError):
        lease.read("embed")
    with pytest.raises(errors.FailedPreconditionError):
        lease.tensors()
    # One release went back: "a" is evictable, and prune frees it.
    assert rt.prune() == 2  # from sim0, then its host copy
    with pytest.raises(errors.NotFoundError):
        with rt.acquire("a") as again:
            again.read("nope")


def test_a_lease_keeps_the_runtime_alive(models):
    registry, arrays = models
    rt = Runtime(registry, 1 << 20, [SimulatedDevice("sim0", 256 * KIB)])
    rt_ref = weakref.ref(rt)
    lease = rt.acquire("b")
    del rt
    collect()
    assert rt_ref() is None
    check_values(lease, arrays["b"])  # device memory still there
    lease.release()
    del lease
    collect()


def test_cuda_is_unavailable_without_a_gpu(models):
    if cuda_available():
        pytest.skip("a GPU is usable here")
    assert cuda_unavailable_reason()
    registry, _ = models
    with pytest.raises(errors.UnavailableError):
        Runtime(registry, 1 << 20, [CudaDevice(0)])
