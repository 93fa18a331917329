"""Plain records the cache returns: stats, entries and events."""

from __future__ import annotations

from dataclasses import asdict, dataclass, make_dataclass
from typing import Any, Dict, List, Optional, Tuple

from . import _core

__all__ = ["CacheStats", "Entry", "Event"]


def _record(name: str, doc: str, fields: List[Tuple[str, str, str]]) -> type:
    """A frozen dataclass with the C++ record's fields, in its order: the
    field list in cache.h is the only one (adding a counter there adds it
    here)."""
    types = {"int": int, "float": float, "bool": bool, "str": str}
    cls = make_dataclass(
        name,
        [(field, types[kind]) for field, kind, _ in fields],
        frozen=True,
        namespace={"as_dict": lambda self: asdict(self)},
    )
    cls.__doc__ = doc + "\n\n" + "\n".join(
        f"``{field}``: {what}" for field, _, what in fields
    )
    cls.__module__ = __name__
    return cls


#: A snapshot of a cache's counters and of its budget.
CacheStats = _record(
    "CacheStats",
    "A snapshot of a cache's counters and of its budget.",
    _core._cache_stats_fields(),
)

#: One model the cache holds; ``last_use`` is on time.monotonic()'s clock.
Entry = _record(
    "Entry",
    "One model the cache holds; last_use is on time.monotonic()'s clock.",
    _core._entry_fields(),
)


@dataclass(frozen=True)
class Event:
    """What on_event receives."""

    #: "loaded", "load_failed", "evicted", "expired", "unload_failed",
    #: "removed", "retired", "retired_freed", "drain_started" or
    #: "drain_ended"
    type: str
    key: str
    bytes: int
    seconds: float  #: load time, for "loaded"
    error: str  #: for "load_failed" and "unload_failed": "ValueError: ..."
    #: For "load_failed" and "unload_failed": the exception the loader or
    #: unloader raised, with its traceback (None for the other events).
    exception: Optional[BaseException] = None
