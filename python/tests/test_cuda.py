"""modelcache.runtime on a real GPU, beside torch.

Every test here needs a usable CUDA GPU (and numpy and torch): it skips,
saying why, where there is none, and fails instead when the environment says
MODELCACHE_REQUIRE_GPU=1 (scripts/gpu-check.sh sets it), so that a GPU run
cannot pass by testing nothing. ctest runs this file on its own
(python_cuda_suite, label "gpu", one GPU test at a time); the rest of the
suite never touches CUDA.

Values are checked exactly: every tensor read back from the GPU is compared
with the array written to the file.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Dict, List

import pytest

from modelcache import errors
from modelcache.runtime import (
    CudaDevice,
    Runtime,
    SimulatedDevice,
    cuda_available,
    cuda_unavailable_reason,
)
from modelcache.weights import save_file

MIB = 1 << 20


def _require_gpu() -> bool:
    return os.environ.get("MODELCACHE_REQUIRE_GPU", "") not in ("", "0")


def _skip_or_fail(why: str) -> None:
    if _require_gpu():
        pytest.fail(f"MODELCACHE_REQUIRE_GPU=1 but {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(autouse=True)
def gpu() -> None:
    if not cuda_available():
        _skip_or_fail("CUDA unavailable: " + cuda_unavailable_reason())


@pytest.fixture
def np():
    try:
        import numpy
    except ImportError as e:  # pragma: no cover - depends on the machine
        _skip_or_fail(f"numpy is missing: {e}")
    return numpy


@pytest.fixture
def torch():
    try:
        import torch as torch_module
    except ImportError as e:  # pragma: no cover - depends on the machine
        _skip_or_fail(f"torch is missing: {e}")
    if not torch_module.cuda.is_available():
        _skip_or_fail("torch sees no CUDA GPU")
    return torch_module


def write_model(np, path: Path, tensors: Dict[str, "object"]) -> Path:
    """A safetensors file of the arrays, with the package's writer."""
    save_file(tensors, path)
    return path


def odd_model(np, seed: int, scale: int) -> Dict[str, "object"]:
    """Tensors of odd byte sizes, so that unaligned offsets would show."""
    rng = np.random.default_rng(seed)
    return {
        "mask": rng.integers(0, 2, 7 + seed, dtype=np.uint8).astype(bool),
        "tokens": rng.integers(0, 255, 1001 * scale + seed, dtype=np.uint8),
        "half": rng.standard_normal(3 * scale + 1).astype("<f2"),
        "weight": rng.standard_normal(scale * 4096 + seed).astype("<f4"),
    }


def registry_of(tmp_path: Path, models: Dict[str, Dict[str, "object"]],
                np) -> Path:
    for name, tensors in models.items():
        write_model(np, tmp_path / f"{name}.safetensors", tensors)
    registry = tmp_path / "models.json"
    registry.write_text(json.dumps({"models": [
        {"id": name, "files": [f"{name}.safetensors"]} for name in models]}))
    return registry


def check_exact(np, lease, tensors: Dict[str, "object"]) -> None:
    placed = {t["name"]: t for t in lease.tensors()}
    for name, want in tensors.items():
        where = placed[name]
        if where["on_device"]:
            assert where["device_offset"] % 256 == 0, (name, where)
        got = lease.read(name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want)


def test_four_threads_read_fifty_models_exactly_beside_torch(tmp_path, np,
                                                             torch):
    # torch first: it holds the GPU's primary context and its caching
    # allocator before modelcache makes its device.
    on_gpu = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    free_before, _ = torch.cuda.mem_get_info()
    models = {f"m{i:02d}": odd_model(np, i, 1 + i % 7) for i in range(50)}
    rt = Runtime(registry_of(tmp_path, models, np), 1 << 30, [CudaDevice(0)])
    memory = rt.stats().memory["cuda:0"]
    assert memory.allocation_granularity == 2 * MIB
    assert 0 < memory.capacity_bytes <= free_before - (1 << 30)
    failures: List[BaseException] = []
    start = threading.Barrier(4)

    def worker(seed: int) -> None:
        try:
            order = list(models) * 2
            random.Random(seed).shuffle(order)
            start.wait()
            for name in order:
                with rt.acquire(name, "cuda:0") as lease:
                    assert lease.full and lease.device == "cuda:0"
                    check_exact(np, lease, models[name])
        except BaseException as e:  # noqa: BLE001 - reported below
            failures.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[0]
    stats = rt.stats()
    assert stats.host.loads == 50  # every file read once
    memory = stats.memory["cuda:0"]
    assert not memory.unusable
    assert memory.bytes_allocated == stats.devices["cuda:0"].resident_bytes
    assert memory.bytes_allocated % (2 * MIB) == 0
    # torch is undisturbed: its tensor, its stream, no error left behind.
    torch.cuda.synchronize()
    assert float(on_gpu.sum().item()) == float((1 << 20) * ((1 << 20) - 1) / 2)
    assert rt.prune() > 0
    assert rt.stats().memory["cuda:0"].bytes_allocated == 0


def test_an_index_that_could_be_taken_for_a_cuda_ordinal_is_refused(tmp_path,
                                                                    np):
    models = {"a": odd_model(np, 1, 1)}
    registry = registry_of(tmp_path, models, np)
    mixed = Runtime(registry, 1 << 26, [SimulatedDevice("sim0", 64 * MIB),
                                        CudaDevice(0, capacity_bytes=64 * MIB)])
    for index in (0, 1):
        with pytest.raises(errors.InvalidArgumentError, match="ambiguous"):
            mixed.acquire("a", index)
    with mixed.acquire("a", "cuda:0") as lease:
        check_exact(np, lease, models["a"])
    with mixed.acquire("a", "sim0") as lease:
        check_exact(np, lease, models["a"])
    only_gpu = Runtime(registry, 1 << 26, [CudaDevice(0, capacity_bytes=64 * MIB)])
    with only_gpu.acquire("a", 0) as lease:  # position 0 is cuda:0
        assert lease.device == "cuda:0"
        check_exact(np, lease, models["a"])


def test_a_model_placed_on_a_gpu_reads_back_exactly(tmp_path, np):
    models = {"a": odd_model(np, 2, 3)}
    rt = Runtime(registry_of(tmp_path, models, np), 1 << 26,
                 [CudaDevice(0, capacity_bytes=64 * MIB),
                  SimulatedDevice("sim0", 64 * MIB)])
    with rt.acquire("a", "cuda:0") as gpu, rt.acquire("a", "sim0") as sim:
        assert gpu.full and gpu.device == "cuda:0"
        check_exact(np, gpu, models["a"])
        check_exact(np, sim, models["a"])
        assert rt.stats().host.loads == 1
        assert rt.stats().memory["cuda:0"].bytes_allocated == 2 * MIB


EXIT_SCRIPT = textwrap.dedent(
    """
    import json, sys, threading
    import numpy as np
    import torch
    from modelcache.runtime import CudaDevice, Runtime
    from modelcache.weights import save_file

    torch.zeros(1, device="cuda")
    folder = sys.argv[1]
    data = np.arange(48 << 20, dtype=np.uint8)
    save_file({"w": data}, folder + "/big.safetensors")
    with open(folder + "/models.json", "w") as f:
        json.dump({"models": [{"id": "big", "files": ["big.safetensors"]}]}, f)
    rt = Runtime(folder + "/models.json", 1 << 30, [CudaDevice(0)])
    copying = threading.Event()

    def copy_forever():
        while True:
            with rt.acquire("big", "cuda:0") as lease:
                copying.set()
                lease.read("w")
            rt.prune()

    threading.Thread(target=copy_forever, daemon=True).start()
    assert copying.wait(120)
    print("done", flush=True)
    """
)


def test_interpreter_exit_with_a_daemon_thread_mid_copy_is_clean(tmp_path, np,
                                                                 torch):
    script = tmp_path / "exit_mid_copy.py"
    script.write_text(EXIT_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(tmp_path)],
                            capture_output=True, text=True, timeout=300,
                            env=os.environ.copy())
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "done", result.stdout


def test_serve_lease_register_cuda_pins_the_shared_mapping(tmp_path, np, torch):
    """modelcache.serve: register_cuda page-locks a daemon's read-only copy;
    copies from it reach the GPU exactly; the pages are unregistered before
    the unmap (a second registration of the same range after the lease is
    gone would otherwise fail with cudaErrorHostMemoryAlreadyRegistered)."""
    import modelcache.serve
    from serve_util import Daemon, write_catalog, write_safetensors

    root = tmp_path / "models"
    root.mkdir()
    weight = np.arange(1 << 20, dtype=np.float32)
    write_safetensors(root / "w.safetensors", {"w": weight})
    write_catalog(tmp_path / "catalog.json", [{"id": "w", "files": ["w.safetensors"]}])
    daemon = Daemon(tmp_path, tmp_path / "catalog.json", root).start()
    try:
        client = modelcache.serve.connect(daemon.socket)
        lease = client.acquire("w")
        reason = lease.register_cuda()
        assert reason is None, reason
        assert lease.cuda_registered
        host = lease.torch("w")
        device = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(device.cpu(), torch.from_numpy(weight))
        del host
        lease.release()
        with client.acquire("w") as again:  # a fresh mapping of the same copy
            assert again.register_cuda() is None
    finally:
        daemon.stop()
