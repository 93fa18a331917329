"""What every lease wrapper shares: ``released``, an idempotent
``release()``, and the context-manager protocol that calls it."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Optional, Type, TypeVar

_Self = TypeVar("_Self", bound="_Releasable")


class _Releasable:
    """Base of the package's lease wrappers around an extension lease."""

    __slots__ = ("_lease",)

    def __init__(self, lease: Any) -> None:
        self._lease = lease

    @property
    def released(self) -> bool:
        """True once :meth:`release` was called."""
        return self._lease.released

    def release(self) -> None:
        """Gives the lease back; later calls do nothing."""
        self._lease.release()

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.release()
