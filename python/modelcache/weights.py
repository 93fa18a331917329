"""Safetensors weights: headers, the host weight store, zero-copy views.

The host weight store keeps one canonical host copy of each safetensors file,
counted once in its byte budget however many users read it, and loads each
file at most once however many threads race for it::

    from modelcache.weights import HostWeightStore, load_state_dict

    store = HostWeightStore(capacity_bytes=8 << 30, mode="mmap")
    with store.acquire("model.safetensors") as weights:
        w = weights.numpy("layer.weight")   # read-only, zero-copy
        t = weights.torch("layer.weight")   # zero-copy, via DLPack

    module.load_state_dict(load_state_dict(store, "model.safetensors"))

Lifetime. A :class:`WeightsLease` holds one reference to a host copy. Every
array or tensor taken from it holds a reference of its own: the copy cannot
be evicted while any view of it exists, even after the lease object is
released or garbage-collected. ``release()`` (or the end of a ``with``
block) gives back the lease object's reference only. A copy nobody
references stays resident, and evictable, until the budget needs its bytes
(or :meth:`HostWeightStore.prune` frees it).

Read-only. The views share the one host copy with every other user (in
``mmap`` mode they are a read-only mapping of the file). numpy arrays are
marked read-only (``flags.writeable`` is False). torch has no read-only
tensors: a tensor from :meth:`WeightsLease.torch` must not be written to; a
write would change every user's weights (``pread`` mode) or crash the
process with SIGSEGV (``mmap`` mode). Copy it (``t.clone()``) to modify it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

from . import _args, _core
from ._lease import _Releasable
from ._types import CacheStats

if TYPE_CHECKING:  # pragma: no cover
    import datetime

    # Aliased: WeightsLease's methods named numpy and torch would shadow
    # the modules in its class body.
    import numpy as _np
    import torch as _torch

__all__ = [
    "inspect",
    "HostWeightStore",
    "WeightsLease",
    "load_state_dict",
    "save_file",
]

#: A filesystem path: str, bytes or os.PathLike.
PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]
#: A timeout: None (no limit), seconds, or a datetime.timedelta.
Timeout = Union[None, float, int, "datetime.timedelta"]


def inspect(path: PathLike) -> Dict[str, Any]:
    """The validated header of the safetensors file at ``path``.

    Reads only the header (not the data), validates every claim it makes
    against the file (see the C++ reader), and returns::

        {"tensors": {name: {"dtype": "F32", "shape": [2, 3],
                            "data_offsets": [begin, end]}, ...},
         "metadata": {"format": "pt", ...},   # {} when there is none
         "header_bytes": N,   # the JSON header's length (file bytes 0..8)
         "data_offset": 8 + N,  # where the data buffer starts in the file
         "data_bytes": D,     # the data buffer's size
         "file_bytes": 8 + N + D}

    ``tensors`` is in data order (by begin offset); ``data_offsets`` are
    relative to the data buffer, as in the file.

    Raises:
        modelcache.errors.InvalidDataError: the file is not a valid
            safetensors file (the message is "<path>: <problem>").
        modelcache.errors.IoError: the file cannot be opened or read.
    """
    return _core._inspect_safetensors(_args.path(path, "path"))


# numpy dtype -> safetensors dtype, for the kinds numpy has (BF16 and the
# F8 kinds travel as (dtype, shape, data) tuples).
_SAFETENSORS_DTYPES = {
    ("b", 1): "BOOL", ("u", 1): "U8", ("i", 1): "I8",
    ("i", 2): "I16", ("u", 2): "U16", ("f", 2): "F16",
    ("i", 4): "I32", ("u", 4): "U32", ("f", 4): "F32",
    ("i", 8): "I64", ("u", 8): "U64", ("f", 8): "F64",
}


def _tensor_entry(name: str, value: Any) -> Tuple[str, str, List[int], Any]:
    """(name, dtype, shape, contiguous little-endian bytes) for one tensor."""
    import numpy as np

    if isinstance(value, tuple):
        if len(value) != 3:
            raise TypeError(f"tensor {name!r}: a tuple must be "
                            f"(dtype, shape, data), got {len(value)} items")
        dtype, shape, data = value
        if not isinstance(dtype, str):
            raise TypeError(f"tensor {name!r}: dtype must be a safetensors "
                            f"dtype name such as 'BF16', got {dtype!r}")
        raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        return (name, dtype, [int(d) for d in shape], raw)
    if not isinstance(value, np.ndarray):
        raise TypeError(f"tensor {name!r}: expected a numpy array or a "
                        f"(dtype, shape, data) tuple, got "
                        f"{type(value).__name__}")
    kind = _SAFETENSORS_DTYPES.get((value.dtype.kind, value.dtype.itemsize))
    if kind is None:
        raise TypeError(f"tensor {name!r}: numpy dtype {value.dtype} has no "
                        f"safetensors equivalent")
    little = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
    return (name, kind, list(value.shape), little.reshape(-1).view(np.uint8))


def save_file(tensors: "Mapping[str, Any]", path: PathLike,
              metadata: "Optional[Mapping[str, str]]" = None) -> int:
    """Writes ``tensors`` to a safetensors file at ``path`` (created or
    truncated) and returns its size in bytes.

    Each value is a numpy array (any byte order or layout; written
    little-endian and C-contiguous) or, for dtypes numpy lacks, a tuple
    ``(dtype, shape, data)``: a safetensors dtype name (``"BF16"``,
    ``"F8_E4M3"``, ...), the shape, and the raw little-endian bytes (any
    buffer). ``metadata`` becomes the ``"__metadata__"`` entry (str to str).

    The file is what the reference implementation writes, and what
    :func:`inspect` and :class:`HostWeightStore` read: the header padded to a
    multiple of 8 bytes, tensors laid out by decreasing element size, so
    every tensor is aligned to its element size. The writer is the C++
    library's (``modelcache/weights/safetensors_writer.h``); it streams the
    bytes without copying them again.

    Raises:
        TypeError: ``tensors`` or ``metadata`` is not a mapping, a name,
            metadata key or value is not a str, a value is neither a numpy
            array nor a
            ``(dtype, shape, data)`` tuple, or its dtype has no safetensors
            equivalent.
        modelcache.errors.InvalidArgumentError: a name is duplicated or is
            ``"__metadata__"``, an unknown dtype name, or a tuple's bytes do
            not match its dtype and shape.
        modelcache.errors.IoError: the file cannot be written (a partly
            written file is removed).
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of name -> array, not "
                        f"{type(tensors).__name__}")
    entries = [_tensor_entry(_args.string(name, "tensors' names"), value)
               for name, value in tensors.items()]
    shown = _args.path(path, "path")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a mapping of str -> str, not "
                        f"{type(metadata).__name__}")
    for key, value in metadata.items():
        _args.string(key, "metadata's keys")
        _args.string(value, f"metadata[{key!r}]")
    return _core._write_safetensors(shown, entries, dict(metadata))


class WeightsLease(_Releasable):
    """One reference to the host copy of a safetensors file.

    A context manager: ``with store.acquire(path) as weights:`` gives the
    lease itself and releases it at the end of the block. Views taken from
    it (:meth:`numpy`, :meth:`torch`, :meth:`raw`) keep the copy alive and
    resident on their own and stay valid after the lease is released.
    After :meth:`release`, taking a new view or listing tensors raises
    :class:`~modelcache.errors.FailedPreconditionError`.
    """

    __slots__ = ("_path", "__weakref__")

    def __init__(self, lease: Any, path: str) -> None:
        """Internal: leases come from :meth:`HostWeightStore.acquire`."""
        super().__init__(lease)
        self._path = path

    @property
    def path(self) -> str:
        """The path the lease was acquired with."""
        return self._path

    @property
    def bytes(self) -> int:
        """The size of the file's data buffer: every tensor's bytes."""
        return self._lease.bytes

    @property
    def mode(self) -> str:
        """How the copy was loaded: "mmap" or "pread"."""
        return self._lease.mode

    def names(self) -> List[str]:
        """The tensor names, in data order."""
        return self._lease.names()

    def tensors(self) -> Dict[str, Dict[str, Any]]:
        """name -> {"dtype", "shape", "data_offsets"}, as :func:`inspect`."""
        return self._lease.tensors()

    def metadata(self) -> Dict[str, str]:
        """The file's ``__metadata__`` strings ({} when it has none)."""
        return self._lease.metadata()

    def numpy(self, name: str) -> "_np.ndarray":
        """A read-only, zero-copy numpy view of tensor ``name``.

        The array's ``base`` holds a reference to the host copy. dtypes map
        to their little-endian numpy types (BOOL -> bool). numpy has no
        bfloat16 or float8: for BF16 and F8_* tensors this raises
        :class:`~modelcache.errors.InvalidArgumentError`; use :meth:`torch`
        (BF16), or :meth:`raw` and reinterpret, e.g.
        ``raw(n).view(numpy.uint16).reshape(shape)``.

        Raises:
            modelcache.errors.NotFoundError: no tensor ``name``.
        """
        return self._lease.numpy(_args.string(name, "name"))

    def raw(self, name: str) -> "_np.ndarray":
        """The bytes of tensor ``name`` as a read-only, zero-copy, 1-D
        uint8 numpy array (any dtype)."""
        return self._lease.raw(_args.string(name, "name"))

    def torch(self, name: str) -> "_torch.Tensor":
        """A zero-copy CPU torch tensor of tensor ``name``, via DLPack.

        The tensor holds a reference to the host copy until torch frees it.
        It must not be written to (see the module docstring). Supported
        dtypes: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL; others
        (U16, U32, U64, F8_*) raise
        :class:`~modelcache.errors.InvalidArgumentError`, as torch 1.13 has
        no such types.
        """
        from torch.utils import dlpack

        capsule, dtype = self._lease.dlpack(_args.string(name, "name"))
        tensor = dlpack.from_dlpack(capsule)
        if dtype == "BOOL":  # exported as U8: torch 1.13's DLPack lacks bool
            import torch

            tensor = tensor.view(torch.bool)
        return tensor

    def __repr__(self) -> str:
        state = " released" if self.released else ""
        return (f"<modelcache.weights.WeightsLease {self._path!r} "
                f"bytes={self.bytes} mode={self.mode}{state}>")


class HostWeightStore:
    """One canonical host copy per safetensors file, in one byte budget.

    Files are keyed by identity (device, inode, size, mtime), so two paths
    to one file share a copy, and a file rewritten in place is loaded again
    by the next acquire. A copy with references (leases or views) is never
    evicted; unreferenced copies are evicted least recently used first when
    a load needs room.

    Args:
        capacity_bytes: the budget for host copies (> 0): an int of bytes
            or a size as the CLI writes it ("16GiB", "500MB"). A
            resident copy counts its data buffer's size; while it loads, the
            whole file's size is reserved.
        mode: "mmap" maps the file read-only (nothing is copied; pages come
            from the page cache) or "pread" reads it into private memory
            with ``pread_threads`` threads.
        name: names the store in error messages.
        pread_threads: threads per "pread" load (>= 1).

    Raises:
        modelcache.errors.InvalidArgumentError: a bad mode or capacity.
    """

    __slots__ = ("_store", "__weakref__")

    def __init__(self, capacity_bytes: Union[int, str], mode: str = "mmap",
                 name: str = "host", *, pread_threads: int = 4) -> None:
        self._store = _core._HostWeightStore(
            _args.byte_size(capacity_bytes, "capacity_bytes"),
            _args.choice(mode, "mode", ("mmap", "pread")),
            _args.string(name, "name"),
            _args.integer(pread_threads, "pread_threads", minimum=1))

    def acquire(self, path: PathLike, *, timeout: Timeout = None,
                when_full: str = "fail") -> WeightsLease:
        """A lease on the host copy of the file at ``path``, loading it if
        it is not resident (at most one load per file at a time; other
        threads wait for it and share it).

        Args:
            path: the safetensors file.
            timeout: bounds every wait (for another thread's load, for
                room): None waits as long as needed.
            when_full: what to do when nothing evictable can make room:
                "fail" raises CapacityError at once, "wait" waits for a
                reference to go until ``timeout``.

        Raises:
            modelcache.errors.InvalidDataError: not a valid safetensors file.
            modelcache.errors.IoError: cannot open or read the file.
            modelcache.errors.TooLargeError: larger than the whole budget.
            modelcache.errors.CapacityError: no room (when_full="fail").
            modelcache.errors.TimeoutError: the timeout passed.
        """
        shown = os.fsdecode(_args.path(path, "path"))
        return WeightsLease(
            self._store.acquire(path, _args.timeout(timeout),
                                _args.choice(when_full, "when_full",
                                             ("fail", "wait"))),
            shown)

    def invalidate(self, path: PathLike) -> str:
        """Retires the copy of the file at ``path``: later acquires load it
        afresh; current holders and views keep the old copy until they let
        go. Returns "removed" (it was unreferenced and is freed),
        "retired" (still referenced) or "not_found"."""
        return self._store.invalidate(_args.path(path, "path"))

    def prune(self) -> int:
        """Frees every copy nobody references; returns how many."""
        return self._store.prune()

    def stats(self) -> CacheStats:
        """A snapshot of the store's counters (the cache's
        :class:`modelcache.CacheStats`): ``loads`` counts files read,
        ``resident_bytes`` the bytes of resident copies (each file once),
        ``budget_used_bytes`` everything the budget counts now."""
        return CacheStats(**self._store.stats())

    @property
    def capacity_bytes(self) -> int:
        """The budget in bytes."""
        return self._store.capacity_bytes

    @property
    def budget_used_bytes(self) -> int:
        """Bytes counted in the budget now: resident and retired copies and
        loads in progress."""
        return self._store.budget_used_bytes

    @property
    def waiters(self) -> int:
        """Threads waiting for room in the budget now (acquires with
        when_full="wait")."""
        return self._store.waiters

    @property
    def name(self) -> str:
        """The store's name."""
        return self._store.name

    @property
    def mode(self) -> str:
        """The load mode: "mmap" or "pread"."""
        return self._store.mode

    def __repr__(self) -> str:
        return (f"<modelcache.weights.HostWeightStore {self.name!r} "
                f"mode={self.mode} used={self.budget_used_bytes}/"
                f"{self.capacity_bytes}>")


def load_state_dict(store: HostWeightStore, path: PathLike, *,
                    timeout: Timeout = None,
                    when_full: str = "fail") -> Dict[str, "_torch.Tensor"]:
    """The tensors of the file at ``path`` as a dict name -> torch tensor
    (in data order), zero-copy views of the store's host copy.

    Each tensor keeps the copy resident until it is freed; pass the dict to
    ``module.load_state_dict`` (which copies) and drop it. The tensors must
    not be written to (see the module docstring). Raises what
    :meth:`HostWeightStore.acquire` and :meth:`WeightsLease.torch` raise.
    """
    if not isinstance(store, HostWeightStore):
        raise TypeError("store must be a modelcache.weights.HostWeightStore, "
                        f"not {type(store).__name__}")
    with store.acquire(path, timeout=timeout, when_full=when_full) as lease:
        return {name: lease.torch(name) for name in lease.names()}
