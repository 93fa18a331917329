"""modelcache: keep machine-learning models resident for inference servers.

A :class:`Cache` loads each model at most once however many threads race for
it, keeps what is hot within a byte :class:`Budget` (shareable between
caches), never evicts a model while a :class:`Lease` on it is held, and never
caches a failed load::

    import modelcache

    cache = modelcache.Cache(capacity_bytes=8 << 30)

    def load():
        model = build_model()
        return modelcache.Loaded(model, modelcache.torch_bytes(model))

    with cache.acquire("sdxl", load, expected_bytes=7 << 30) as model:
        model(inputs)

Threads: blocking calls release the GIL (so loads of different models run in
parallel), loaders, unloaders and event callbacks run with the GIL on the
calling thread and outside the cache's locks, and Ctrl-C interrupts a blocked
wait on the main thread. See docs/python.md.
"""

from __future__ import annotations

from typing import Any, List, Optional

from . import _core, runtime, serve, weights
from ._core import Budget, Lease, Loaded, policy_names
from ._types import CacheStats, Entry, Event
from .errors import (
    CapacityError,
    DaemonUnavailableError,
    Error,
    FailedPreconditionError,
    InvalidArgumentError,
    InvalidDataError,
    IoError,
    LoadError,
    NotFoundError,
    TimeoutError,
    TooLargeError,
    UnavailableError,
)

__all__ = [
    "Budget",
    "Cache",
    "CacheStats",
    "CapacityError",
    "DaemonUnavailableError",
    "Entry",
    "Error",
    "Event",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "InvalidDataError",
    "IoError",
    "Lease",
    "LoadError",
    "Loaded",
    "NotFoundError",
    "TimeoutError",
    "TooLargeError",
    "UnavailableError",
    "policy_names",
    "runtime",
    "serve",
    "torch_bytes",
    "weights",
]

# The project's version, from CMakeLists.txt (compiled into the extension).
__version__: str = _core.__version__


class Cache(_core.Cache):
    __doc__ = _core.Cache.__doc__

    def stats(self) -> CacheStats:
        """A snapshot of the counters, and of the budget's usage."""
        return CacheStats(**self._stats_dict())

    def entries(self) -> List[Entry]:
        """Every model the cache holds (loading, resident, retired...)."""
        return [Entry(**e) for e in self._entries()]

    def entry(self, key: str) -> Optional[Entry]:
        """The entry ``key`` (or its alias target) names, or None."""
        e = self._entry(key)
        return None if e is None else Entry(**e)


def torch_bytes(module_or_state_dict: Any) -> int:
    """Bytes a torch model's tensors occupy: parameters and buffers of a
    ``torch.nn.Module``, or the tensors of a state dict (a mapping of names
    to tensors). Tensors sharing storage are counted once."""
    if hasattr(module_or_state_dict, "state_dict") and callable(
        module_or_state_dict.state_dict
    ):
        tensors = list(module_or_state_dict.state_dict(keep_vars=True).values())
    elif hasattr(module_or_state_dict, "values"):
        tensors = list(module_or_state_dict.values())
    else:
        raise InvalidArgumentError(
            "module_or_state_dict must be a torch.nn.Module or a state dict, "
            "not " + type(module_or_state_dict).__name__
        )
    seen = set()
    total = 0
    for t in tensors:
        if not hasattr(t, "untyped_storage") and not hasattr(t, "storage"):
            raise InvalidArgumentError(
                "module_or_state_dict: not a tensor: " + type(t).__name__
            )
        # Whole storages, once each: a view keeps its whole storage alive.
        storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
        ident = (storage.data_ptr(), t.device.type, t.device.index)
        if ident in seen:
            continue
        seen.add(ident)
        total += storage.nbytes()
    return total
