"""modelcache.weights: safetensors headers, the host weight store, and the
zero-copy views that keep their host copy alive.

Written from the contract in modelcache/weights.py. Expected values come from
an independent reading of the files (struct + json + numpy.frombuffer here),
never from the package itself. Real files are read from the shared data
folder (MODELCACHE_SHARED_DATA, else <repo>/../shared/data); larger files are
written by hand (struct + json) into tmp_path.
"""

from __future__ import annotations

import gc
import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

from modelcache import errors  # noqa: E402
from modelcache.weights import (  # noqa: E402
    HostWeightStore,
    WeightsLease,
    inspect,
    load_state_dict,
    save_file,
)

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = Path(os.environ.get("MODELCACHE_SHARED_DATA") or REPO / ".." / "shared" / "data")
WEIGHTS_DIR = SHARED_DATA / "weights"
MALFORMED = WEIGHTS_DIR / "syoyo" / "safetensors_abuse_attempt_1.safetensors"

NP_DTYPES = {
    "BOOL": np.dtype("?"), "U8": np.dtype("u1"), "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"), "I16": np.dtype("<i2"), "F16": np.dtype("<f2"),
    "U32": np.dtype("<u4"), "I32": np.dtype("<i4"), "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"), "I64": np.dtype("<i8"), "F64": np.dtype("<f8"),
}
TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
    "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


# ---------------------------------------------------------------------------
# An independent reader (files are written with the package's writer,
# modelcache.weights.save_file, which the save_file tests check against it)
# ---------------------------------------------------------------------------


def read_header(path: Path) -> Tuple[int, dict]:
    """(N, parsed JSON header) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def expected_arrays(path: Path) -> Dict[str, "np.ndarray"]:
    """name -> array for every tensor numpy has a type for."""
    n, header = read_header(path)
    raw = path.read_bytes()
    out = {}
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] not in NP_DTYPES:
            continue
        dt = NP_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        arr = np.frombuffer(raw, dtype=dt, count=(end - begin) // dt.itemsize,
                            offset=8 + n + begin)
        out[name] = arr.reshape(info["shape"])
    return out


def write_safetensors(path: Path, tensors: Dict[str, Tuple[str, List[int], bytes]],
                      metadata: Optional[Dict[str, str]] = None) -> Path:
    """Writes tensors (name -> (dtype, shape, bytes)) with the package's
    writer; returns the path."""
    save_file(tensors, path, metadata)
    return path


def write_f32(path: Path, values: "np.ndarray", name: str = "w") -> Path:
    save_file({name: np.asarray(values, dtype="<f4")}, path)
    return path


def data_bytes(path: Path) -> int:
    n, _ = read_header(path)
    return path.stat().st_size - 8 - n


def address(view) -> int:
    if isinstance(view, torch.Tensor):
        return view.data_ptr()
    return view.__array_interface__["data"][0]


def real_files() -> List[Path]:
    files = sorted(p for p in WEIGHTS_DIR.rglob("*.safetensors") if p != MALFORMED)
    return files


def collect() -> None:
    # Twice: a first pass may only break the cycles that keep a second set of
    # objects alive.
    gc.collect()
    gc.collect()


def wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    """Polls observable state (not a sleep standing in for synchronisation)."""
    event = threading.Event()  # never set: wait() is a bounded pause
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        event.wait(0.001)


# ---------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------


def test_shared_data_has_the_real_files():
    # Guards the parametrised tests below against silently testing nothing.
    assert WEIGHTS_DIR.is_dir(), f"shared data folder {WEIGHTS_DIR} is missing"
    assert len(real_files()) >= 20
    assert MALFORMED.is_file()


@pytest.mark.parametrize("path", real_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_inspect_matches_an_independent_reading_of_every_real_file(path):
    n, header = read_header(path)
    got = inspect(path)
    assert got["header_bytes"] == n
    assert got["data_offset"] == 8 + n
    assert got["file_bytes"] == path.stat().st_size
    assert got["data_bytes"] == path.stat().st_size - 8 - n
    assert got["metadata"] == header.get("__metadata__", {})
    expected = {k: v for k, v in header.items() if k != "__metadata__"}
    assert set(got["tensors"]) == set(expected)
    for name, info in expected.items():
        assert got["tensors"][name] == {"dtype": info["dtype"], "shape": info["shape"],
                                        "data_offsets": info["data_offsets"]}
    # In data order.
    begins = [t["data_offsets"][0] for t in got["tensors"].values()]
    assert begins == sorted(begins)
    # str and bytes paths are the same file.
    assert inspect(os.fsencode(path)) == got


def test_inspect_rejects_the_malformed_file_with_the_readers_message():
    with pytest.raises(errors.InvalidDataError) as info:
        inspect(MALFORMED)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert message.startswith(f"{MALFORMED}: ")
    assert "\n" not in message
    # Loading it fails the same way, and counts nothing.
    store = HostWeightStore(1 << 20)
    with pytest.raises(errors.InvalidDataError) as loaded:
        store.acquire(MALFORMED)
    assert str(loaded.value) == message
    assert store.budget_used_bytes == 0


def test_a_missing_file_is_an_io_error_that_is_also_an_oserror(tmp_path):
    missing = tmp_path / "missing.safetensors"
    with pytest.raises(errors.IoError) as info:
        inspect(missing)
    assert isinstance(info.value, OSError)
    assert str(missing) in str(info.value)
    store = HostWeightStore(1 << 20)
    with pytest.raises(errors.IoError):
        store.acquire(missing)
    assert store.budget_used_bytes == 0


def test_a_truncated_file_is_invalid_data_and_nothing_stays_counted(tmp_path):
    good = write_f32(tmp_path / "good.safetensors", np.arange(64))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(good.read_bytes()[:-4])
    with pytest.raises(errors.InvalidDataError) as info:
        inspect(bad)
    assert str(bad) in str(info.value)
    store = HostWeightStore(1 << 20)
    for _ in range(2):  # a failure is not cached: each acquire tries again
        with pytest.raises(errors.InvalidDataError):
            store.acquire(bad)
    stats = store.stats()
    assert stats.load_failures == 2
    assert stats.loads == 0
    assert store.budget_used_bytes == 0
    assert stats.resident_entries == 0


# ---------------------------------------------------------------------------
# numpy and torch views
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["mmap", "pread"])
def test_numpy_views_equal_the_file_in_both_modes(mode):
    store = HostWeightStore(64 << 20, mode=mode)
    assert store.mode == mode
    checked = 0
    for path in real_files():
        _, header = read_header(path)
        with store.acquire(path) as lease:
            assert lease.mode == mode
            assert lease.path == str(path)
            assert lease.bytes == data_bytes(path)
            assert lease.names() == list(inspect(path)["tensors"])
            assert lease.metadata() == header.get("__metadata__", {})
            for name, want in expected_arrays(path).items():
                got = lease.numpy(name)
                assert got.dtype == want.dtype and got.shape == want.shape, name
                np.testing.assert_array_equal(got, want)
                assert not got.flags.writeable
                raw = lease.raw(name)
                assert raw.dtype == np.uint8 and raw.tobytes() == want.tobytes()
                checked += 1
    assert checked >= 60
    assert store.stats().loads == len(real_files())


def test_numpy_views_are_read_only_and_zero_copy(tmp_path):
    path = write_f32(tmp_path / "a.safetensors", np.arange(1024))
    store = HostWeightStore(1 << 20)
    with store.acquire(path) as first, store.acquire(path) as second:
        a, b = first.numpy("w"), second.numpy("w")
        # One host copy: both views address the same bytes, and neither
        # array owns them.
        assert address(a) == address(b)
        assert not a.flags.owndata
        with pytest.raises(ValueError):
            a[0] = 5
        with pytest.raises(ValueError):
            a.setflags(write=True)
        assert address(first.raw("w")) == address(a)
        np.testing.assert_array_equal(a, np.arange(1024, dtype="<f4"))


def test_torch_views_cover_every_supported_dtype_zero_copy_and_without_warnings(tmp_path):
    gen = torch.Generator().manual_seed(7)
    made = {
        "f64": torch.randn(3, 4, generator=gen, dtype=torch.float64),
        "i64": torch.randint(-1000, 1000, (5,), generator=gen, dtype=torch.int64),
        "f32": torch.randn(2, 3, 2, generator=gen),
        "i32": torch.randint(-1000, 1000, (7,), generator=gen, dtype=torch.int32),
        "f16": torch.randn(6, generator=gen).to(torch.float16),
        "bf16": torch.randn(2, 5, generator=gen).to(torch.bfloat16),
        "i16": torch.randint(-1000, 1000, (3,), generator=gen, dtype=torch.int16),
        "i8": torch.randint(-100, 100, (9,), generator=gen, dtype=torch.int8),
        "u8": torch.randint(0, 255, (4, 2), generator=gen, dtype=torch.uint8),
        "bool": torch.rand(11, generator=gen) > 0.5,
        "scalar": torch.tensor(42, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
    }
    names = {torch.float64: "F64", torch.int64: "I64", torch.float32: "F32",
             torch.int32: "I32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}

    def raw_bytes(t):
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().tobytes()
        return t.numpy().tobytes()

    path = write_safetensors(tmp_path / "all.safetensors", {
        name: (names[t.dtype], list(t.shape), raw_bytes(t)) for name, t in made.items()})
    store = HostWeightStore(1 << 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # -X dev shows them; here they fail
        with store.acquire(path) as lease:
            for name, want in made.items():
                got = lease.torch(name)
                assert got.dtype == want.dtype, name
                assert got.shape == want.shape, name
                assert torch.equal(got, want), name
                assert got.device.type == "cpu"
                if want.numel():
                    # Zero-copy: the tensor addresses the host copy.
                    assert address(got) == address(lease.raw(name)), name
            loaded = load_state_dict(store, path)
    assert list(loaded) == list(inspect(path)["tensors"])
    for name, want in made.items():
        assert torch.equal(loaded[name], want)


def test_dtypes_without_a_numpy_or_torch_type_raise_invalid_argument(tmp_path):
    path = write_safetensors(tmp_path / "odd.safetensors", {
        "bf16": ("BF16", [2], b"\x80\x3f\x00\x40"),
        "u16": ("U16", [2], struct.pack("<2H", 1, 65535)),
        "f8": ("F8_E4M3", [3], b"\x01\x02\x03"),
    })
    store = HostWeightStore(1 << 20)
    with store.acquire(path) as lease:
        with pytest.raises(errors.InvalidArgumentError, match="bf16.*BF16"):
            lease.numpy("bf16")
        with pytest.raises(errors.InvalidArgumentError, match="F8_E4M3"):
            lease.numpy("f8")
        with pytest.raises(errors.InvalidArgumentError, match="U16"):
            lease.torch("u16")
        with pytest.raises(errors.InvalidArgumentError, match="F8_E4M3"):
            lease.torch("f8")
        # What the messages point to works: torch for BF16, raw for anything.
        assert lease.torch("bf16").tolist() == [1.0, 2.0]
        assert lease.raw("bf16").view("<u2").tolist() == [0x3F80, 0x4000]
        assert lease.numpy("u16").tolist() == [1, 65535]
        assert lease.raw("f8").tolist() == [1, 2, 3]
        with pytest.raises(errors.InvalidArgumentError):
            load_state_dict(store, path)


def test_scalars_and_empty_tensors_view_as_numpy(tmp_path):
    path = write_safetensors(tmp_path / "shapes.safetensors", {
        "scalar": ("F64", [], struct.pack("<d", 2.5)),
        "empty": ("F32", [4, 0, 3], b""),
        "row": ("I32", [1, 3], struct.pack("<3i", 7, 8, 9)),
    })
    store = HostWeightStore(1 << 20)
    with store.acquire(path) as lease:
        scalar = lease.numpy("scalar")
        assert scalar.shape == () and scalar.dtype == np.float64 and scalar[()] == 2.5
        empty = lease.numpy("empty")
        assert empty.shape == (4, 0, 3) and empty.dtype == np.float32 and empty.size == 0
        assert not empty.flags.writeable
        assert lease.raw("empty").shape == (0,)
        assert lease.numpy("row").tolist() == [[7, 8, 9]]


def test_unknown_names_and_released_leases_raise_clear_errors(tmp_path):
    path = write_f32(tmp_path / "a.safetensors", np.arange(8))
    store = HostWeightStore(1 << 20)
    lease = store.acquire(path)
    with pytest.raises(errors.NotFoundError, match="'nope'"):
        lease.numpy("nope")
    with pytest.raises(KeyError):
        lease.torch("nope")
    view = lease.numpy("w")
    lease.release()
    assert lease.released
    for call in (lambda: lease.numpy("w"), lambda: lease.torch("w"), lease.names):
        with pytest.raises(errors.FailedPreconditionError):
            call()
    np.testing.assert_array_equal(view, np.arange(8, dtype="<f4"))


# ---------------------------------------------------------------------------
# Lifetime: views keep their copy
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("mode", ["mmap", "pread"])
def test_a_view_keeps_its_copy_resident_after_the_lease_is_released_and_collected(
        tmp_path, kind, mode):
    values = np.arange(256 * 1024, dtype="<f4")  # 1 MiB
    a = write_f32(tmp_path / "a.safetensors", values)
    b = write_f32(tmp_path / "b.safetensors", values * 2)
    # Room for one file (and its load's reservation), not two.
    store = HostWeightStore(a.stat().st_size * 3 // 2, mode=mode)

    lease = store.acquire(a)
    # A derived view (a slice) is what is kept: it must hold the copy too.
    view = (lease.numpy("w") if kind == "numpy" else lease.torch("w"))[5:]
    lease_ref, view_ref = weakref.ref(lease), weakref.ref(view)
    lease.release()
    del lease
    collect()
    assert lease_ref() is None

    # b needs a's bytes, and a's only holder is the view: no room.
    with pytest.raises(errors.CapacityError):
        store.acquire(b)
    assert store.prune() == 0
    stats = store.stats()
    assert stats.evictions == 0
    assert stats.resident_entries == 1
    assert stats.resident_bytes == data_bytes(a)
    assert store.budget_used_bytes == data_bytes(a)
    np.testing.assert_array_equal(np.asarray(view), values[5:])

    del view
    collect()
    assert view_ref() is None
    # Now a is evictable: b's load evicts it.
    with store.acquire(b) as lease_b:
        np.testing.assert_array_equal(lease_b.numpy("w"), values * 2)
        stats = store.stats()
        assert stats.evictions == 1
        assert stats.resident_bytes == data_bytes(b)


def test_every_view_holds_its_own_reference(tmp_path):
    a = write_f32(tmp_path / "a.safetensors", np.arange(1000))
    store = HostWeightStore(1 << 20)
    with store.acquire(a) as lease:
        views = [lease.numpy("w"), lease.torch("w"), lease.raw("w")]
    refs = [weakref.ref(v) for v in views]
    while views:
        assert store.prune() == 0, f"{len(views)} views left, the copy was freed"
        views.pop()
        collect()
    assert all(r() is None for r in refs)
    assert store.prune() == 1
    assert store.budget_used_bytes == 0


def test_the_last_view_may_go_on_another_thread(tmp_path):
    a = write_f32(tmp_path / "a.safetensors", np.arange(1000))
    store = HostWeightStore(1 << 20)
    with store.acquire(a) as lease:
        box = [lease.torch("w"), lease.numpy("w")]
    done = threading.Event()

    def drop():
        box.clear()
        collect()
        done.set()

    t = threading.Thread(target=drop)
    t.start()
    t.join()
    assert done.is_set()
    assert store.prune() == 1
    assert store.budget_used_bytes == 0


def test_views_outlive_the_store_object(tmp_path):
    values = np.arange(4096, dtype="<f4")
    a = write_f32(tmp_path / "a.safetensors", values)
    store = HostWeightStore(1 << 20, mode="pread")
    store_ref = weakref.ref(store)
    lease = store.acquire(a)
    array, tensor = lease.numpy("w"), lease.torch("w")
    del store, lease
    collect()
    assert store_ref() is None
    np.testing.assert_array_equal(array, values)
    assert torch.equal(tensor, torch.from_numpy(values.copy()))
    del array, tensor
    collect()


def test_release_is_idempotent_and_with_gives_the_lease(tmp_path):
    a = write_f32(tmp_path / "a.safetensors", np.arange(100))
    store = HostWeightStore(1 << 20)
    with store.acquire(a) as lease:
        assert isinstance(lease, WeightsLease)
        assert not lease.released
    assert lease.released
    lease.release()
    lease.release()
    # Exactly one reference went back: the copy is unreferenced, so prune
    # frees it (a double release would have broken the books or crashed).
    assert store.prune() == 1
    assert store.budget_used_bytes == 0
    stats = store.stats()
    assert (stats.loads, stats.evictions) == (1, 1)


def test_load_state_dict_is_zero_copy_and_keeps_the_copy_until_dropped(tmp_path):
    w1 = np.arange(12, dtype="<f4").reshape(3, 4)
    b1 = np.array([1.5, -2.5], dtype="<f4")
    path = write_safetensors(tmp_path / "m.safetensors", {
        "layer.weight": ("F32", [3, 4], w1.tobytes()),
        "layer.bias": ("F32", [2], b1.tobytes()),
    })
    store = HostWeightStore(1 << 20)
    sd = load_state_dict(store, path)
    assert list(sd) == ["layer.weight", "layer.bias"]
    assert torch.equal(sd["layer.weight"], torch.from_numpy(w1))
    assert torch.equal(sd["layer.bias"], torch.from_numpy(b1))
    # The two tensors are views of one buffer: bias follows weight.
    assert sd["layer.bias"].data_ptr() == sd["layer.weight"].data_ptr() + w1.nbytes
    # It is usable by torch as a state dict.
    module = torch.nn.Linear(4, 3)
    module.load_state_dict({"weight": sd["layer.weight"], "bias": torch.zeros(3)})
    assert torch.equal(module.weight.detach(), torch.from_numpy(w1))
    assert store.prune() == 0  # held by the dict's tensors
    del sd
    collect()
    assert store.prune() == 1


# ---------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------


def test_full_store_fails_or_times_out_as_asked(tmp_path):
    a = write_f32(tmp_path / "a.safetensors", np.arange(64 * 1024))
    b = write_f32(tmp_path / "b.safetensors", np.arange(64 * 1024) + 1)
    store = HostWeightStore(a.stat().st_size * 3 // 2)
    with store.acquire(a):
        with pytest.raises(errors.CapacityError):
            store.acquire(b)
        with pytest.raises(errors.TimeoutError) as info:
            store.acquire(b, when_full="wait", timeout=0.05)
        assert isinstance(info.value, TimeoutError)  # the builtin, too
    big = write_f32(tmp_path / "big.safetensors", np.arange(256 * 1024))
    with pytest.raises(errors.TooLargeError):
        store.acquire(big)
    assert store.stats().refused == 3


def test_a_waiting_acquire_proceeds_when_the_last_view_goes(tmp_path):
    a = write_f32(tmp_path / "a.safetensors", np.arange(64 * 1024))
    b = write_f32(tmp_path / "b.safetensors", np.arange(64 * 1024) + 1)
    store = HostWeightStore(a.stat().st_size * 3 // 2)
    with store.acquire(a) as lease:
        view = lease.numpy("w")
    result: Dict[str, object] = {}

    def waiter():
        try:
            with store.acquire(b, when_full="wait", timeout=60) as lb:
                result["first"] = float(lb.numpy("w")[0])
        except BaseException as e:  # reported by the main thread
            result["error"] = e

    t = threading.Thread(target=waiter)
    t.start()
    wait_until(lambda: store.waiters == 1 or not t.is_alive(), "the acquire waits for room")
    assert t.is_alive(), result
    del view
    collect()
    t.join(60)
    assert not t.is_alive()
    assert result == {"first": 1.0}
    assert store.stats().evictions == 1


def test_concurrent_acquires_of_one_file_load_it_once(tmp_path):
    values = np.arange(512 * 1024, dtype="<f4")
    path = write_f32(tmp_path / "a.safetensors", values)
    store = HostWeightStore(8 << 20, mode="pread")
    threads = 8
    barrier = threading.Barrier(threads)
    views: List[object] = [None] * threads
    failures: List[BaseException] = []

    def worker(i):
        try:
            barrier.wait()
            with store.acquire(path) as lease:
                views[i] = lease.numpy("w")
        except BaseException as e:
            failures.append(e)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not failures
    stats = store.stats()
    assert stats.loads == 1
    assert stats.hits + stats.misses == threads
    assert len({address(v) for v in views}) == 1
    assert stats.resident_bytes == data_bytes(path)
    np.testing.assert_array_equal(views[3], values)


def test_two_paths_to_one_file_share_one_copy(tmp_path):
    a = write_f32(tmp_path / "a.safetensors", np.arange(100))
    linked = tmp_path / "linked.safetensors"
    os.link(a, linked)
    symlink = tmp_path / "sym.safetensors"
    symlink.symlink_to(a)
    store = HostWeightStore(1 << 20)
    with store.acquire(a) as x, store.acquire(linked) as y, store.acquire(symlink) as z:
        assert address(x.numpy("w")) == address(y.numpy("w")) == address(z.numpy("w"))
        assert y.path == str(linked)
    stats = store.stats()
    assert stats.loads == 1
    assert stats.resident_bytes == data_bytes(a)


def test_pread_copies_are_private_and_mmap_shows_the_file(tmp_path):
    values = np.arange(1024, dtype="<f4")
    views = {}
    for mode in ("mmap", "pread"):
        path = write_f32(tmp_path / f"{mode}.safetensors", values)
        store = HostWeightStore(1 << 20, mode=mode)
        with store.acquire(path) as lease:
            views[mode] = lease.numpy("w")
        # Rewrite the first value in place (same file, same size).
        n, _ = read_header(path)
        with open(path, "r+b") as f:
            f.seek(8 + n)
            f.write(struct.pack("<f", -1.0))
    assert views["pread"][0] == 0.0  # read once, into private memory
    assert views["mmap"][0] == -1.0  # a shared mapping of the file


def test_invalidate_retires_a_referenced_copy_and_the_next_acquire_reloads(tmp_path):
    values = np.arange(1000, dtype="<f4")
    path = write_f32(tmp_path / "a.safetensors", values)
    store = HostWeightStore(1 << 20, mode="pread")
    with store.acquire(path) as lease:
        old = lease.numpy("w")
    assert store.invalidate(path) == "retired"
    assert store.invalidate(path) == "not_found"
    with store.acquire(path) as lease:
        new = lease.numpy("w")
    assert address(new) != address(old)
    assert store.stats().loads == 2
    assert store.stats().retired_bytes == data_bytes(path)
    np.testing.assert_array_equal(old, values)
    del old
    collect()
    stats = store.stats()
    assert (stats.retired_entries, stats.retired_bytes) == (0, 0)
    del new
    collect()
    assert store.invalidate(path) == "removed"
    assert store.budget_used_bytes == 0


def test_bad_arguments_raise_invalid_argument(tmp_path):
    path = write_f32(tmp_path / "a.safetensors", np.arange(10))
    with pytest.raises(errors.InvalidArgumentError, match="mode"):
        HostWeightStore(1 << 20, mode="direct")
    with pytest.raises(errors.InvalidArgumentError):
        HostWeightStore(0)
    with pytest.raises(errors.InvalidArgumentError):
        HostWeightStore(1 << 20, pread_threads=0)
    store = HostWeightStore(1 << 20)
    with pytest.raises(errors.InvalidArgumentError, match="when_full"):
        store.acquire(path, when_full="sometimes")
    with pytest.raises(errors.InvalidArgumentError, match="timeout"):
        store.acquire(path, timeout=-1)
    with pytest.raises(TypeError):
        store.acquire(42)
    assert store.stats().misses == 0  # nothing reached the store


def test_save_file_writes_every_numpy_dtype_as_an_independent_reader_reads_it(tmp_path):
    rng = np.random.default_rng(7)
    arrays = {
        f"{code.lower()}": (rng.integers(0, 2, size=(3, 5)).astype(dt) if code == "BOOL"
                            else rng.integers(0, 100, size=(3, 5)).astype(dt))
        for code, dt in NP_DTYPES.items()
    }
    # Any byte order and layout: written little-endian and C-contiguous.
    arrays["big_endian"] = np.arange(6, dtype=">i4").reshape(2, 3)
    arrays["transposed"] = np.arange(6, dtype="<f8").reshape(2, 3).T
    arrays["scalar"] = np.array(2.5, dtype="<f4")
    arrays["empty"] = np.zeros((4, 0), dtype="<i2")
    path = tmp_path / "all.safetensors"
    size = save_file(arrays, path, {"format": "np", "note": "ünïcode"})
    assert size == path.stat().st_size
    header_bytes, header = read_header(path)
    assert header_bytes % 8 == 0, "the data buffer starts 8-aligned"
    assert header["__metadata__"] == {"format": "np", "note": "ünïcode"}
    for name, info in header.items():
        if name != "__metadata__":
            begin = info["data_offsets"][0]
            assert begin % NP_DTYPES.get(info["dtype"], np.dtype("u1")).itemsize == 0, name
    got = expected_arrays(path)
    assert set(got) == set(arrays)
    for name, want in arrays.items():
        assert got[name].shape == want.shape, name
        assert np.array_equal(got[name], want), name
    assert header["big_endian"]["dtype"] == "I32"
    assert header["transposed"]["shape"] == [3, 2]
    # And the library's reader agrees.
    assert inspect(path)["file_bytes"] == size


def test_save_file_rewrites_a_real_file_with_its_exact_tensors(tmp_path):
    original = real_files()[0]
    info = inspect(original)
    store = HostWeightStore(1 << 30)
    with store.acquire(original) as lease:
        tensors = {name: (t["dtype"], t["shape"], lease.raw(name))
                   for name, t in info["tensors"].items()}
        copy = tmp_path / "copy.safetensors"
        save_file(tensors, copy, info["metadata"])
        raw = {name: lease.raw(name).tobytes() for name in info["tensors"]}
    again = inspect(copy)
    assert again["metadata"] == info["metadata"]
    assert again["data_bytes"] == info["data_bytes"]
    with store.acquire(copy) as lease:
        for name, t in info["tensors"].items():
            assert again["tensors"][name]["dtype"] == t["dtype"], name
            assert again["tensors"][name]["shape"] == t["shape"], name
            assert lease.raw(name).tobytes() == raw[name], name


@pytest.mark.parametrize("tensors, error, match", [
    ({"a": [1.0, 2.0]}, TypeError, "numpy array or a \\(dtype, shape, data\\) tuple"),
    ({"a": np.zeros(2, dtype=np.complex64)}, TypeError, "no safetensors equivalent"),
    ({"a": ("F32", [2])}, TypeError, "\\(dtype, shape, data\\)"),
    ({"a": ("X9", [1], b"1")}, errors.InvalidArgumentError, "unknown safetensors dtype 'X9'"),
    ({"a": ("F32", [2], b"1234")}, errors.InvalidArgumentError, "needs 8 bytes, got 4"),
    ({"__metadata__": np.zeros(1)}, errors.InvalidArgumentError, "__metadata__"),
])
def test_save_file_rejects_bad_tensors_and_writes_nothing(tmp_path, tensors, error, match):
    path = tmp_path / "bad.safetensors"
    with pytest.raises(error, match=match):
        save_file(tensors, path)
    assert not path.exists()


def test_save_file_into_a_missing_folder_raises_io_error(tmp_path):
    with pytest.raises(errors.IoError):
        save_file({"a": np.zeros(1)}, tmp_path / "missing" / "a.safetensors")


def test_the_interpreter_exits_cleanly_with_views_leases_and_waiters_alive(tmp_path):
    # Views, leases and a store in globals, a torch tensor, a runtime lease,
    # and a daemon thread blocked in acquire waiting for room: exiting must
    # neither crash nor hang, and say nothing on stderr.
    a = write_f32(tmp_path / "a.safetensors", np.arange(4096))
    b = write_f32(tmp_path / "b.safetensors", np.arange(4096) + 1)
    registry = tmp_path / "models.json"
    registry.write_text(json.dumps({"models": [{"id": "a", "files": [str(a)]}]}))
    script = textwrap.dedent(f"""
        import threading
        from modelcache.runtime import Runtime, SimulatedDevice
        from modelcache.weights import HostWeightStore

        STORE = HostWeightStore({a.stat().st_size * 3 // 2})
        LEASE = STORE.acquire({str(a)!r})
        VIEW = LEASE.numpy("w")
        TENSOR = LEASE.torch("w")
        def wait_for_room():
            STORE.acquire({str(b)!r}, when_full="wait")
        threading.Thread(target=wait_for_room, daemon=True).start()
        while STORE.waiters < 1:
            pass
        RT = Runtime({str(registry)!r}, 1 << 20, [SimulatedDevice("sim0", 1 << 20)])
        MODEL = RT.acquire("a", "sim0")
        print("done", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-X", "dev", "-c", script],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done", proc.stdout + proc.stderr
    assert proc.stderr == ""
