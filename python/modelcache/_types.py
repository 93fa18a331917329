"""Plain records the cache returns: stats, entries and events."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict

__all__ = ["CacheStats", "Entry", "Event"]


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of a cache's counters and of its budget."""

    hits: int  #: acquires and lookups that found the key resident
    misses: int  #: acquires that started or joined a load; failed lookups
    refused: int  #: misses not admitted: too large, no capacity, timed out
    loads: int  #: loads that completed
    load_failures: int
    evictions: int
    expirations: int
    failed_unloads: int
    removals: int  #: models unloaded or retired by remove/invalidate
    bytes_loaded: int
    load_seconds: float
    resident_entries: int
    resident_bytes: int
    retired_entries: int
    retired_bytes: int
    capacity_bytes: int  #: of the budget
    budget_used_bytes: int  #: of the budget, every cache on it together
    high_water_bytes: int  #: of the budget
    wasted_evictions: int  #: of the budget: evictions for a reservation that failed anyway
    callback_errors: int  #: on_event calls that raised

    def as_dict(self) -> Dict[str, Any]:
        """The stats as a plain dict (for JSON)."""
        return asdict(self)


@dataclass(frozen=True)
class Entry:
    """One model the cache holds."""

    key: str
    state: str  #: "loading", "resident", "unloading" or "retired"
    bytes: int
    leases: int
    waiters: int  #: threads blocked on its load or unload
    pinned: bool
    accesses: int
    last_use: float  #: when it last became idle, on time.monotonic()'s clock

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Event:
    """What on_event receives."""

    #: "loaded", "load_failed", "evicted", "expired", "unload_failed",
    #: "removed", "retired" or "retired_freed"
    type: str
    key: str
    bytes: int
    seconds: float  #: load time, for "loaded"
    error: str  #: for "load_failed" and "unload_failed"
