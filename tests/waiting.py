"""Waiting for a positive signal, with a deadline: `wait_until(predicate, what, timeout_s)` polls
until the predicate returns something truthy and returns it, or fails naming what it waited for
and how long. (A fixed sleep proves nothing; this is the one way tests wait.)"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], what: str, timeout_s: float = 300.0, every_s: float = 0.2) -> T:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(every_s)
    return value
