"""The multi-device model runtime: models from a registry, placed on devices.

A :class:`Runtime` keeps one canonical host copy of each weight file in a
host budget shared by every device, and one cache of placed models per
device. A model placed on two devices is read from disk once and its host
bytes are counted once::

    from modelcache.runtime import Runtime, SimulatedDevice

    rt = Runtime("models.json", host_capacity_bytes=8 << 30,
                 devices=[SimulatedDevice("sim0", 4 << 30),
                          SimulatedDevice("sim1", 4 << 30)])
    with rt.acquire("llama", "sim0") as a, rt.acquire("llama", "sim1") as b:
        assert rt.stats().host.loads == 1

The registry is a JSON file::

    {"models": [{"id": "llama", "files": ["llama.safetensors"],
                 "aliases": ["latest"], "pinned": false, "size_bytes": 0}]}

Relative file paths are relative to the JSON file's folder; unknown keys,
wrong types and duplicate names are errors (InvalidDataError).

Devices are :class:`SimulatedDevice` (host RAM standing in for a GPU, with a
capacity and a modelled bandwidth), :class:`HostDevice` or
:class:`CudaDevice`, or dicts with the same fields and a "kind" key
("simulated", "host", "cuda"). A CUDA device raises
:class:`~modelcache.errors.UnavailableError` when the build or the machine
has no usable GPU (see :func:`cuda_available`).

Devices are chosen by name ("sim0", "cuda:1") or by an integer index, which
is a *position in the runtime's device list*, not a CUDA ordinal. Where the
two could be confused (the position holds a GPU other than ``cuda:<index>``,
or ``cuda:<index>`` sits at another position) an index raises
InvalidArgumentError: pass the name.

On a GPU, every placed tensor starts 256-byte aligned in the model's device
buffer, and a device's books count each buffer rounded up to the allocator's
2 MiB pages (``DeviceStats.allocation_granularity``). A device whose CUDA
context was corrupted (a kernel's illegal address, anywhere in the process)
is unusable: every call raises UnavailableError saying so, and
``DeviceStats.unusable`` is set; the process must restart to use the GPU.

CUDA and ``fork()``: :func:`cuda_available` and making a :class:`CudaDevice`
initialise the CUDA driver, which a child process forked afterwards cannot
use. A server that forks its workers should call them in the workers, or
start the workers with the "spawn" method.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Sequence, Union

from . import _args, _core
from ._lease import _Releasable
from ._types import CacheStats
from .errors import InvalidArgumentError

if TYPE_CHECKING:  # pragma: no cover
    import datetime
    import os

    import numpy as _np

__all__ = [
    "Runtime",
    "ModelLease",
    "RuntimeStats",
    "DeviceStats",
    "SimulatedDevice",
    "HostDevice",
    "CudaDevice",
    "cuda_available",
    "cuda_unavailable_reason",
]

PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]
Timeout = Union[None, float, int, "datetime.timedelta"]


@dataclasses.dataclass(frozen=True)
class SimulatedDevice:
    """A stand-in for a GPU: host RAM with a byte capacity. Copies really
    copy; their modelled time (bytes / bandwidth) is summed in the device's
    stats, and nothing sleeps.

    Args:
        name: the device's name (in stats and error messages; must be
            unique within a runtime).
        capacity_bytes: the device's memory, an int of bytes or a size
            as the CLI writes it ("8GiB"); so is working_reserve_bytes.
        working_reserve_bytes: kept free of models (for activations): the
            device's model budget is capacity minus this.
        bandwidth_bytes_per_second: the modelled host-to-device bandwidth.
    """

    name: str
    capacity_bytes: Union[int, str]
    working_reserve_bytes: Union[int, str] = 0
    bandwidth_bytes_per_second: float = 16e9

    kind = "simulated"


@dataclasses.dataclass(frozen=True)
class HostDevice:
    """Ordinary host RAM as a device (CPU inference). ``capacity_bytes`` 0
    means the machine's physical memory."""

    name: str = "host"
    capacity_bytes: Union[int, str] = 0
    working_reserve_bytes: Union[int, str] = 0

    kind = "host"


@dataclasses.dataclass(frozen=True)
class CudaDevice:
    """GPU ``ordinal`` through the CUDA backend, named "cuda:<ordinal>".
    ``capacity_bytes`` 0 means the GPU's free memory when the runtime is
    made less a headroom of max(1 GiB, 5% of the GPU's memory), left for
    the CUDA libraries and frameworks (torch's caching allocator, cuBLAS
    workspaces) that allocate later. The books count allocations in 2 MiB
    pages, so a capacity below 2 MiB holds nothing. Raises UnavailableError
    when the runtime is made if CUDA cannot be used."""

    ordinal: int = 0
    capacity_bytes: Union[int, str] = 0
    working_reserve_bytes: Union[int, str] = 0

    kind = "cuda"


DeviceSpec = Union[SimulatedDevice, HostDevice, CudaDevice, Mapping[str, Any]]

_FIELDS = {
    "simulated": {"name", "capacity_bytes", "working_reserve_bytes",
                  "bandwidth_bytes_per_second"},
    "host": {"name", "capacity_bytes", "working_reserve_bytes"},
    "cuda": {"ordinal", "capacity_bytes", "working_reserve_bytes"},
}


def _normalise_device(spec: DeviceSpec) -> Dict[str, Any]:
    """The dict _core._Runtime takes: every key present."""
    if isinstance(spec, (SimulatedDevice, HostDevice, CudaDevice)):
        fields = dataclasses.asdict(spec)
        kind = spec.kind
    elif isinstance(spec, Mapping):
        fields = dict(spec)
        kind = fields.pop("kind", None)
        if kind not in _FIELDS:
            raise InvalidArgumentError(
                f"device kind must be 'simulated', 'host' or 'cuda', "
                f"not {kind!r}")
        unknown = set(fields) - _FIELDS[kind]
        if unknown:
            raise InvalidArgumentError(
                f"unknown keys for a {kind} device: {sorted(unknown)}")
        if kind == "simulated" and not {"name", "capacity_bytes"} <= set(fields):
            raise InvalidArgumentError(
                "a simulated device needs 'name' and 'capacity_bytes'")
    else:
        raise InvalidArgumentError(
            f"a device must be SimulatedDevice, HostDevice, CudaDevice or a "
            f"dict, not {type(spec).__name__}")
    out: Dict[str, Any] = {
        "kind": kind,
        "name": _args.string(fields.get("name", "host"), "name"),
        "ordinal": _args.integer(fields.get("ordinal", 0), "ordinal", 0),
        "capacity_bytes": _args.byte_size(fields.get("capacity_bytes", 0),
                                          "capacity_bytes", allow_zero=True),
        "working_reserve_bytes": _args.byte_size(
            fields.get("working_reserve_bytes", 0), "working_reserve_bytes",
            allow_zero=True),
        "bandwidth_bytes_per_second": _args.number(
            fields.get("bandwidth_bytes_per_second", 16e9),
            "bandwidth_bytes_per_second"),
    }
    if kind == "simulated" and out["capacity_bytes"] <= 0:
        raise InvalidArgumentError(
            f"simulated device {out['name']!r}: capacity_bytes must be > 0")
    if out["capacity_bytes"] < 0 or out["working_reserve_bytes"] < 0:
        raise InvalidArgumentError("byte counts must be >= 0")
    return out


@dataclasses.dataclass(frozen=True)
class DeviceStats:
    """A snapshot of one device's own books (its memory and copies)."""

    capacity_bytes: int
    #: every allocation is counted rounded up to this (2 MiB on CUDA)
    allocation_granularity: int
    bytes_allocated: int  #: live buffers and allocations in progress, rounded
    high_water_bytes: int
    allocations: int  #: that succeeded
    frees: int
    failed_allocations: int
    copies_to_device: int
    copies_to_host: int
    bytes_copied_to_device: int
    bytes_copied_to_host: int
    failed_copies: int
    synchronizations: int
    #: the simulated backend's modelled transfer time; 0 for other backends
    simulated_transfer_seconds: float
    #: the device can never be used again in this process (a corrupted CUDA
    #: context); every call raises UnavailableError with the reason
    unusable: bool = False
    unusable_reason: str = ""


@dataclasses.dataclass(frozen=True)
class RuntimeStats:
    """A snapshot of a runtime: the host store, and per device (by name)
    its cache of placed models and its memory."""

    #: the host weight store: ``loads`` counts files read from disk,
    #: ``resident_bytes`` counts each resident file once
    host: CacheStats
    #: device name -> the device cache (placed models; bytes on device)
    devices: Dict[str, CacheStats]
    #: device name -> the device's own books
    memory: Dict[str, DeviceStats]


def cuda_available() -> bool:
    """True when this build has the CUDA backend and a GPU can be used.

    It initialises the CUDA driver: a process forked after it cannot use
    CUDA (call it after forking workers, or start them with "spawn")."""
    return _core._cuda_available()


def cuda_unavailable_reason() -> str:
    """Why CUDA cannot be used ("" when it can)."""
    return _core._cuda_unavailable_reason()


class ModelLease(_Releasable):
    """A claim on a model placed on one device: while it is held the model
    stays on that device (and its host copies stay resident).

    A context manager: ``with runtime.acquire(...) as lease:`` gives the
    lease itself and releases it at the end of the block. ``release()`` is
    idempotent. The attributes below are fixed when the lease is taken and
    stay readable after release; :meth:`tensors` and :meth:`read` raise
    FailedPreconditionError once it is released.
    """

    __slots__ = ("__weakref__",)

    def __init__(self, lease: Any) -> None:
        """Internal: leases come from :meth:`Runtime.acquire`."""
        super().__init__(lease)

    @property
    def model(self) -> str:
        """The model id (aliases resolved)."""
        return self._lease.model

    @property
    def device(self) -> str:
        """The device's name."""
        return self._lease.device

    @property
    def bytes_on_device(self) -> int:
        """Bytes of the model's tensors placed on the device."""
        return self._lease.bytes_on_device

    @property
    def total_bytes(self) -> int:
        """Bytes of all the model's tensors (its files' data buffers)."""
        return self._lease.total_bytes

    @property
    def full(self) -> bool:
        """True when every tensor is on the device (a "partial" placement
        may leave some on the host)."""
        return self._lease.full

    def tensors(self) -> List[Dict[str, Any]]:
        """Where each tensor is: dicts with name, dtype, shape, bytes,
        on_device and device_offset (None when on the host), in file
        order."""
        return self._lease.tensors()

    def read(self, name: str, *, raw: bool = False) -> "_np.ndarray":
        """A fresh, writable numpy copy of tensor ``name`` read back from
        where it is placed (device memory, or the host copy). With
        ``raw=True`` its bytes as a 1-D uint8 array (any dtype); otherwise
        dtypes numpy lacks (BF16, F8_*) raise InvalidArgumentError."""
        return self._lease.read(_args.string(name, "name"),
                                _args.boolean(raw, "raw"))

    def __repr__(self) -> str:
        state = " released" if self.released else ""
        return (f"<modelcache.runtime.ModelLease {self.model!r} on "
                f"{self.device!r} {self.bytes_on_device}/{self.total_bytes} "
                f"bytes{state}>")


class Runtime:
    """Models of a registry placed on devices over one shared host store.

    Args:
        registry_json_path: the registry (see the module docstring).
        host_capacity_bytes: the host budget for weight files (> 0): an
            int of bytes or a size as the CLI writes it ("16GiB").
        devices: the devices, in index order.
        mode: how host copies are read: "mmap" or "pread".
        pread_threads: threads per "pread" load.

    Raises:
        modelcache.errors.InvalidDataError: a bad registry.
        modelcache.errors.IoError: the registry cannot be read.
        modelcache.errors.UnavailableError: a CUDA device cannot be used.
        modelcache.errors.InvalidArgumentError: bad devices or options.
    """

    __slots__ = ("_runtime", "__weakref__")

    def __init__(self, registry_json_path: PathLike,
                 host_capacity_bytes: Union[int, str],
                 devices: Sequence[DeviceSpec] = (), *, mode: str = "mmap",
                 pread_threads: int = 4) -> None:
        if isinstance(devices, (Mapping, str, bytes)):
            raise InvalidArgumentError("devices must be a list of devices")
        if not isinstance(devices, Sequence):
            raise TypeError("devices must be a list of devices, not "
                            + type(devices).__name__)
        specs = [_normalise_device(d) for d in devices]
        self._runtime = _core._Runtime(
            _args.path(registry_json_path, "registry_json_path"),
            _args.byte_size(host_capacity_bytes, "host_capacity_bytes"),
            specs, _args.choice(mode, "mode", ("mmap", "pread")),
            _args.integer(pread_threads, "pread_threads", minimum=1))

    def acquire(self, model: str, device: Union[int, str] = 0,
                placement: str = "full", *, timeout: Timeout = None,
                when_full: str = "fail") -> ModelLease:
        """A lease on ``model`` (an id or alias) placed on ``device`` (a
        device name, or a position in the runtime's device list: not a CUDA
        ordinal, and refused where it could be taken for one), loading and
        placing it if needed.

        Args:
            placement: "full" puts every tensor on the device, evicting
                unleased models as needed, or fails. "partial" places a full
                copy if eviction can make room, otherwise the tensors that
                fit (in file order) and leaves the rest on the host.
            timeout, when_full: as for ``HostWeightStore.acquire``.

        Raises:
            modelcache.errors.NotFoundError: unknown model or device name.
            modelcache.errors.InvalidArgumentError: bad or ambiguous index,
                bad option.
            modelcache.errors.TooLargeError: the model exceeds the device
                budget (placement "full") or the host budget.
            modelcache.errors.CapacityError: no room (when_full="fail").
            modelcache.errors.InvalidDataError, IoError: bad weight files.
            modelcache.errors.UnavailableError: the device is unusable (a
                corrupted CUDA context).
        """
        if isinstance(device, bool) or not isinstance(device, (int, str)):
            raise TypeError("device must be a device name (str) or a "
                            f"position (int), not {type(device).__name__}")
        return ModelLease(self._runtime.acquire(
            _args.string(model, "model"), device,
            _args.choice(placement, "placement", ("full", "partial")),
            _args.timeout(timeout),
            _args.choice(when_full, "when_full", ("fail", "wait"))))

    def stats(self) -> RuntimeStats:
        """A snapshot of the host store, each device cache and each
        device's memory (see :class:`RuntimeStats`)."""
        raw = self._runtime.stats()
        return RuntimeStats(
            host=CacheStats(**raw["host"]),
            devices={name: CacheStats(**d["cache"])
                     for name, d in raw["devices"].items()},
            memory={name: DeviceStats(**d["device"])
                    for name, d in raw["devices"].items()})

    def prune(self) -> int:
        """Frees every unleased placed model and then every unreferenced
        host copy; returns how many were freed."""
        return self._runtime.prune()

    @property
    def device_names(self) -> List[str]:
        """The devices' names, in index order."""
        return self._runtime.device_names

    @property
    def models(self) -> List[str]:
        """The registry's model ids."""
        return self._runtime.models

    def __repr__(self) -> str:
        return (f"<modelcache.runtime.Runtime devices={self.device_names} "
                f"models={len(self.models)}>")
