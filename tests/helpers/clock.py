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
