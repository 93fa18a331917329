"""The exceptions modelcache raises.

Every error the package raises is a :class:`Error`. Each subclass matches one
of the core's error codes (``Error.code`` names it), and where a builtin
exception means the same thing the subclass is that builtin too, so existing
``except KeyError`` or ``except TimeoutError`` clauses keep working.

A loader's own exception is not wrapped for the thread that ran the loader: it
arrives unchanged. Every other thread that waited for that load receives a
:class:`LoadError` whose ``__cause__`` is the loader's exception object.
"""

from __future__ import annotations

import builtins

__all__ = [
    "Error",
    "TooLargeError",
    "CapacityError",
    "TimeoutError",
    "NotFoundError",
    "InvalidArgumentError",
    "FailedPreconditionError",
    "InvalidDataError",
    "IoError",
    "UnavailableError",
    "DaemonUnavailableError",
    "LoadError",
]


class Error(Exception):
    """Base of every exception modelcache raises."""

    #: The core's name for the kind of failure ("capacity", "timeout", ...).
    code: str = "error"

    #: For errors of :mod:`modelcache.serve`: the daemon's protocol code
    #: ("NOT_FOUND", "TOO_LARGE", "CAPACITY", "TIMEOUT", "LOAD_FAILED",
    #: "BUSY", "INVALID", "UNAVAILABLE"); None for every other error.
    serve_code: "str | None" = None


class TooLargeError(Error):
    """The model is larger than the whole budget; nothing was evicted for it."""

    code = "too_large"


class CapacityError(Error):
    """Nothing evictable could make room: every resident byte is leased,
    pinned or loading. The message names what holds the memory."""

    code = "capacity"


class TimeoutError(Error, builtins.TimeoutError):
    """The timeout passed while waiting for a load, an unload or capacity."""

    code = "timeout"


class NotFoundError(Error, KeyError):
    """The key, model, alias or file is not known where it must be."""

    code = "not_found"

    def __str__(self) -> str:  # KeyError would print the repr
        return Exception.__str__(self)


class InvalidArgumentError(Error, ValueError):
    """An argument is wrong whatever the state (a bad policy name, a negative
    timeout, an alias naming itself)."""

    code = "invalid_argument"


class FailedPreconditionError(Error, RuntimeError):
    """The call cannot succeed in the current state, e.g. a loader acquiring
    the very key it is loading, which would wait for itself forever."""

    code = "failed_precondition"


class InvalidDataError(Error, ValueError):
    """A file's bytes are not valid for its format (safetensors, registry)."""

    code = "invalid_data"


class IoError(Error, OSError):
    """The operating system or a device refused an I/O operation."""

    code = "io"


class UnavailableError(Error):
    """A resource the call needs cannot be used here (no GPU, no driver).

    From :mod:`modelcache.serve`: a limit of the daemon was reached
    (``serve_code`` "BUSY"), or the model is unavailable (``serve_code``
    "UNAVAILABLE"): its files cannot be opened or are not valid safetensors
    files, the message names the file, and ``cause`` says which ("io",
    "invalid_data"). The daemon serves it again once they are valid.
    """

    code = "unavailable"


class DaemonUnavailableError(UnavailableError, ConnectionError):
    """:mod:`modelcache.serve`: the daemon cannot be reached (no socket at
    the path, nobody listening, the connection was lost and could not be
    made again before the deadline) or it is shutting down. Leases already
    held stay mapped and valid; the next call connects again."""

    code = "unavailable"


class LoadError(Error):
    """Another thread's loader for the key this call waited on raised.

    ``__cause__`` is the loader's exception object. The failure is not
    cached: the next acquire of the key loads again.

    From :mod:`modelcache.serve`: the daemon could not load the model's
    files; ``cause`` says why ("io": they could not be read,
    "invalid_data": they are not valid safetensors files).
    """

    code = "load_failed"
