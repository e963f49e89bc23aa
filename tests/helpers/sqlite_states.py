"""Gateway processes' state stores on one SQLite file, each holding a lease (as every
worker of `run --workers N` does), for tests of what they share."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

from gateway.services.state.sqlite import SqliteState

__all__ = ["leased_states"]


@contextlib.asynccontextmanager
async def leased_states(path: Path, count: int = 2, *,
                        beat: float = 0.1) -> AsyncIterator[list[SqliteState]]:
    """`count` stores on `path`, leased in slots `slot-<i>`; with a short `beat`, each
    has counted every one's lease (`processes`) before the block; closed after it."""
    states = [SqliteState(path) for _ in range(count)]
    try:
        for i, state in enumerate(states):
            await state.start()
            await state.take_lease(f"slot-{i}", beat=beat)
        deadline = time.monotonic() + 10
        while beat < 1 and any(s.processes != count for s in states):
            assert time.monotonic() < deadline, [s.processes for s in states]
            await asyncio.sleep(0.05)
        yield states
    finally:
        for state in states:
            await state.close()
