"""Follow the shared records other processes write: every `WATCH` seconds ask the state
store whether a record of each followed kind was written anywhere (`record_version`, no
network I/O: SQLite's change counter, read only when the file changed; Redis's `record`
events on its pub/sub channel) and run what follows that kind when one was.

Ask mode follows its grants (loaded at once: a held request they cover goes on), its
approvals (every held ask reads its own) and the MCP tool pins (their local view).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping

from gateway.services.polling import Poller
from gateway.services.state.base import Records

__all__ = ["WATCH", "RecordWatcher"]

WATCH = 0.05  # seconds between checks (a grant reaches every held request within this)

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

    def start(self) -> None:
        self._poll()
