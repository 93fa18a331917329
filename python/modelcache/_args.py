"""Argument checks for the public functions of the Python modules.

A wrong argument reaches the user as Python's own functions report one,
naming the parameter: TypeError for a wrong type, InvalidArgumentError (a
ValueError) for a wrong value. Without these checks a wrong type would reach
the extension module, whose error lists pybind11's overloads instead.
Byte sizes follow the CLI's grammar, the extension's parser (base/bytes.h's
ParseBytes): an int, or "16GiB", "500MB", "1.5GiB", "4096".
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from . import _core
from .errors import InvalidArgumentError


def _kind(value: Any) -> str:
    return type(value).__name__


def byte_size(value: Any, name: str, *, allow_zero: bool = False) -> int:
    """An int of bytes from an int or a byte size string."""
    return _core._byte_size(value, name, allow_zero)


def string(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {_kind(value)}")
    return value


def choice(value: Any, name: str, choices: Sequence[str]) -> str:
    string(value, name)
    if value not in choices:
        shown = ", ".join(repr(c) for c in choices)
        raise InvalidArgumentError(f"{name} must be one of {shown}, not {value!r}")
    return value


def boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, not {_kind(value)}")
    return value


def integer(value: Any, name: str, minimum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, not {_kind(value)}")
    value = value.__index__()
    if minimum is not None and value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    return value


def number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, not {_kind(value)}")
    return float(value)


def path(value: Any, name: str) -> Any:
    """A str, bytes or os.PathLike path, returned as given."""
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise TypeError(
            f"{name} must be a path (str, bytes or os.PathLike), not {_kind(value)}")
    os.fspath(value)  # a PathLike whose __fspath__ is wrong raises here
    return value


def timeout(value: Any, name: str = "timeout") -> Any:
    """None, seconds (>= 0) or a timedelta, returned as given."""
    _core._check_timeout(value, name)
    return value


def seconds(value: Any, name: str) -> Any:
    """Seconds (a number >= 0) or a timedelta, returned as given. Unlike a
    timeout, None (the protocol's longest) is not one."""
    import datetime

    if isinstance(value, bool) or not isinstance(
            value, (int, float, datetime.timedelta)):
        raise TypeError(
            f"{name} must be a number of seconds or a timedelta, not {_kind(value)}")
    _core._check_timeout(value, name)  # >= 0, not NaN
    return value
