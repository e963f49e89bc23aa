"""Follow the shared records other processes write: ask the state store whether a record
of each followed kind was written anywhere (`record_version`, no network I/O: SQLite's
change counter, read only when the file changed; Redis's `record` events on its pub/sub
channel) and run what follows that kind when one was.

When to ask: when the store says a record may have been written (`record_wakeup`: this
process's writes; SQLite's file written by any process, heard from inotify; Redis's
channel), and again `AGAIN` later (SQLite marks a commit in its shared-memory index just
after the WAL write inotify reports), and at least every `QUIET` seconds in case a
notice was lost. A store that cannot tell is asked every `WATCH` seconds. An idle
worker is no longer woken twenty times a second (docs/performance.md, "idle CPU").

Ask mode follows its grants (loaded at once: a held request they cover goes on), its
approvals (every held ask reads its own) and the MCP tool pins (their local view).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping

from gateway.services.polling import Poller
from gateway.services.state.base import Records

__all__ = ["AGAIN", "QUIET", "WATCH", "RecordWatcher"]

log = logging.getLogger("sandbox_gateway.polling")

WATCH = 0.05  # seconds between checks of a store that cannot say when it changed
AGAIN = 0.02  # a second look this long after a notice
QUIET = 0.5  # seconds between checks without any notice (one lost is late by this much)

Follow = Callable[[], Awaitable[None] | None]


class RecordWatcher(Poller):
    """Runs `follow[kind]` when a record of `kind` was written (by any process)."""

    interval = WATCH
    _poll_name = "record-watcher"

    def __init__(self, store: Records, follow: Mapping[str, Follow]) -> None:
        self.store = store
        self.follow = dict(follow)
        self._seen = {kind: store.record_version(kind) for kind in self.follow}

    def add(self, kind: str, follow: Follow) -> None:
        """Follow one more kind (from now on)."""
        self.follow[kind] = follow
        self._seen[kind] = self.store.record_version(kind)

    async def check(self) -> bool:
        changed = False
        for kind, follow in list(self.follow.items()):
            version = self.store.record_version(kind)
            if version == self._seen[kind]:
                continue
            self._seen[kind] = version
            changed = True
            done = follow()
            if inspect.isawaitable(done):
                await done
        return changed

    async def run(self) -> None:
        """Check on every notice of a write (and `AGAIN` after it), else every `QUIET`
        seconds; a store without notices is polled every `WATCH` seconds."""
        wakeup = self.store.record_wakeup()
        if wakeup is None:
            await super().run()
            return
        while True:
            noticed = False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(QUIET):
                    noticed = await wakeup.wait()
            wakeup.clear()
            await self._check()
            if noticed:
                await asyncio.sleep(AGAIN)
                await self._check()

    async def _check(self) -> None:
        try:
            await self.check()
        except Exception:  # keep what is in use whatever happens
            log.exception("%s: check failed", self._poll_name)

    def start(self) -> None:
        self._poll()
