"""Feeds the console's request log (`log.py`) from the audit sink.

The sink hands over each line it writes (`add`, a list append: nothing on the hot path
waits for the store); every `INTERVAL` the gathered lines go to the state store in one
batch, so every process's lines land where any process's console can read them. The
store being slow or away never holds up a request: at most `HOLD` lines wait, the
oldest beyond that are dropped from the request log (counted:
`sandbox_gateway_request_log_dropped_lines_total`). The audit trail itself is the
sink's, and loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Any

from gateway.observability import metrics
from gateway.services.state.base import StateUnavailable
from gateway.services.state.log import LogEntry, LogLines

__all__ = ["HOLD", "INTERVAL", "RequestLog"]

log = logging.getLogger("sandbox_gateway")

INTERVAL = 0.25  # seconds between batches
HOLD = 20_000  # lines held while the store does not take them


class RequestLog:
    """Gathers audit lines and writes them to the store's request log in batches."""

    def __init__(self, store: LogLines, *, interval: float = INTERVAL,
                 hold: int = HOLD) -> None:
        self.store = store
        self.interval = interval
        self.hold = hold
        self._pending: deque[LogEntry] = deque(maxlen=hold)
        self._timer: asyncio.TimerHandle | None = None
        self._writing: asyncio.Task[None] | None = None
        self._failing = False
        self.closed = False

    def add(self, record: dict[str, Any], at: float, line: bytes) -> None:
        """An audit line as written (`line` ends with a newline)."""
        if self.closed:
            return
        if len(self._pending) == self.hold:
            metrics.REQUEST_LOG_DROPPED.inc()  # (the oldest goes)
        # The fields now, not the record: a tuple of strings is soon untracked by the
        # garbage collector; a quarter second of held records was traced at every
        # collection (measured in `make bench`: 5 µs of a request's CPU).
        self._pending.append(LogEntry.of(record, at, line[:-1].decode("utf-8", "replace")))
        if self._timer is None:
            with contextlib.suppress(RuntimeError):  # (no loop: a command, a unit test)
                self._timer = asyncio.get_running_loop().call_later(self.interval,
                                                                    self._due)

    def _due(self) -> None:
        self._timer = None
        if self._writing is None or self._writing.done():
            self._writing = asyncio.get_running_loop().create_task(self.flush(),
                                                                   name="request-log")
        elif self._pending:  # (the last batch is still being written)
            self._timer = asyncio.get_running_loop().call_later(self.interval, self._due)

    async def flush(self) -> None:
        """Write what is gathered now (kept, within `hold`, when the store fails)."""
        batch, self._pending = self._pending, deque(maxlen=self.hold)
        if not batch:
            return
        try:
            await self.store.log_append(batch)
        except (StateUnavailable, OSError) as exc:
            if not self._failing:
                self._failing = True
                log.warning("request log: the state store did not take %d line(s) (%s); "
                            "held and retried (the audit trail is not affected)",
                            len(batch), exc)
            newer, self._pending = self._pending, batch  # (batch: at most `hold`, oldest first)
            excess = len(batch) + len(newer) - self.hold
            if excess > 0:
                metrics.REQUEST_LOG_DROPPED.inc(excess)
            self._pending.extend(newer)
            if self._timer is None and not self.closed:
                self._timer = asyncio.get_running_loop().call_later(1.0, self._due)
            return
        if self._failing:
            self._failing = False
            log.warning("request log: the state store takes lines again")

    async def aclose(self) -> None:
        """Write what is gathered (before the store closes)."""
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._writing is not None:
            with contextlib.suppress(Exception):
                await self._writing
        with contextlib.suppress(Exception):
            await self.flush()
