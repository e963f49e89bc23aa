"""Poll a directory on the event loop: `check()` every `interval` seconds until `stop()`.

The policy reloader and the signing-key watcher both follow files an operator (or
git-sync, or a ConfigMap) replaces underneath the running gateway; this is their shared
loop. A failing check is logged and the loop goes on: what is in use stays in use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod

log = logging.getLogger("sandbox_gateway.polling")


class Poller(ABC):
    """Subclasses set `interval` and implement `check` (True when something changed)."""

    interval: float
    _task: asyncio.Task[None] | None = None
    _poll_name = "poller"  # the task's name, and what a failed check's log line names

    @abstractmethod
    async def check(self) -> bool:
        """Poll once; True when a change was taken over."""

    async def run(self) -> None:
        """Poll forever every `interval` seconds."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check()
            except Exception:  # keep what is in use whatever happens
                log.exception("%s: check failed", self._poll_name)

    def _poll(self) -> asyncio.Task[None]:
        """Start polling on the running loop (once)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run(),
                                                                name=self._poll_name)
        return self._task

    async def stop(self) -> None:
        """Stop polling and wait for the task to end."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
