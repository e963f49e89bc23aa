"""The admin API's uvicorn server, as the gateway runs it.

uvicorn's own server installs signal handlers (the gateway owns SIGTERM/SIGINT), wakes
ten times a second to look at `should_exit` (ten wake-ups a second of an idle worker:
docs/performance.md, "idle CPU"), and pauses a fixed 0.1 s in `shutdown()` even with no
connection open. `AdminServer` ticks once a second (the Date header), is woken at once
by a stop (`should_exit` sets an event), and skips the pause when no admin connection
is open: a gateway stops in milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

from uvicorn.server import Server as UvicornServer

__all__ = ["AdminServer"]


class AdminServer(UvicornServer):
    """uvicorn without its signal handling, woken once a second and at once by a stop
    (see the module's docstring)."""

    _stop: asyncio.Event

    @property
    def should_exit(self) -> bool:
        return self._stop.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if not hasattr(self, "_stop"):
            self._stop = asyncio.Event()
        if value:
            self._stop.set()
        else:
            self._stop.clear()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def main_loop(self) -> None:
        while not await self.on_tick(0):  # (tick 0: the once-a-second work each time)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._stop.wait()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, without its fixed 0.1 s pause (for open connections to see their
        shutdown) when no admin connection is open: a stop then takes milliseconds."""
        if self.server_state.connections or self.server_state.tasks:
            await super().shutdown(sockets)
            return
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        if not self.force_exit:
            await self.lifespan.shutdown()
