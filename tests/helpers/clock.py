"""Small shared test utilities: a settable clock and a sync runner for coroutines."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run[T](coro: Coroutine[Any, Any, T]) -> T:
    """Run one coroutine to completion on a fresh event loop."""
    return asyncio.run(coro)


class Clock:
    """A monotonic clock the test moves by setting `now`."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def far_window(margin: float = 900) -> str:
    """A budget window (epoch-aligned, as the gateway counts them) whose current one ends
    more than `margin` seconds from now, so that a budget used up in it is final (no
    Retry-After: budgets.RETRY_AFTER_MAX) at whatever time of day a test runs. Daily
    windows end at 00:00 UTC; a 25h and a 24h30m one end there with it only once in
    years."""
    import time

    now = time.time()
    for seconds in (86400, 90000, 88200):
        if seconds - now % seconds > margin:
            return f"{seconds}s"
    raise AssertionError("every candidate window ends within the margin")
