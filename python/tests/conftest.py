"""Shared helpers for the Python suite.

Concurrency tests synchronise on state they can observe (an entry's waiters,
a budget's waiters, events and barriers), never on sleeps; `spin_until`
polls such state, and its bound only turns a hang into a failure.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import pytest


def spin_until(condition: Callable[[], bool], what: str, bound: float = 60.0) -> None:
    give_up = time.monotonic() + bound
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError("never: " + what)
        time.sleep(0)  # yields the GIL to the threads being waited for


@pytest.fixture
def shared_data() -> Path:
    """../shared/data, as ctest passes it (MODELCACHE_SHARED_DATA)."""
    env = os.environ.get("MODELCACHE_SHARED_DATA")
    path = Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"
    if not path.is_dir():
        pytest.fail(f"shared data folder {path} is missing")
    return path
