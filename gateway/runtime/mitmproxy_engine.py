"""mitmproxy, the engine for what the HTTP/1 engine does not serve, started when needed.

With `network.intercept: fast` (the default) the gateway serves its ports with its own
doors, and mitmproxy (its proxy server, every layer, HTTP/2 through h2, QUIC through
aioquic, its command parser: about 20 MiB a process) is loaded and started at the first
connection a door hands to it, an HTTP/2-only client. A worker that never sees one never
holds it. With `network.intercept: mitmproxy` it serves the ports itself and is started
with the gateway.

Started either way, it takes the gateway's listeners as its own (`patches.install_
listeners`), so its proxy server reports and closes them as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mitmproxy.master import Master

log = logging.getLogger("sandbox_gateway")

START_TIMEOUT = 10.0  # seconds for mitmproxy's servers to come up


class EngineFailed(RuntimeError):
    """mitmproxy did not start; the message says why."""


class MitmproxyEngine:
    """One mitmproxy Master for this process, built by `build` at the first `start()`."""

    def __init__(self, build: Callable[[], Master],
                 abandoned: Callable[[tuple[str, int]], None]) -> None:
        self._build = build
        self._abandoned = abandoned  # a handed-off client mitmproxy never took: closed
        self.master: Master | None = None
        self.task: asyncio.Task[Any] | None = None
        self._starting: asyncio.Task[Master] | None = None

    @property
    def started(self) -> bool:
        return self.master is not None

    async def start(self) -> Master:
        """The running Master (built and started once, by the first caller)."""
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(
                self._start(), name="mitmproxy-start")
        return await asyncio.shield(self._starting)

    async def _start(self) -> Master:
        loop = asyncio.get_running_loop()
        began = loop.time()
        master = self.master = self._build()
        self.task = loop.create_task(master.run(), name="mitmproxy")
        servers = master.addons.get("proxyserver").servers
        while not (len(servers) and all(s.is_running for s in servers)):
            if self.task.done():
                raise EngineFailed(f"mitmproxy failed to start: {self.task.exception()}")
            if loop.time() - began > START_TIMEOUT:
                raise EngineFailed(f"mitmproxy did not start within {START_TIMEOUT:g}s")
            await asyncio.sleep(0.005)
        log.info("mitmproxy engine started in %.0f ms", (loop.time() - began) * 1000)
        return master

    def handoff(self, mode: str) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                             Awaitable[None]]:
        """The hand-off a door gives a connection to: mitmproxy's `handle_stream` for
        listener `mode` (regular, transparent), once mitmproxy runs."""

        async def handle_stream(reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
            try:
                master = await self.start()
                server = next((s for s in master.addons.get("proxyserver").servers
                               if s.mode.type_name == mode), None)
                if server is None:  # (cannot happen: the modes are the gateway's)
                    raise EngineFailed(f"mitmproxy has no {mode} listener")
            except Exception as exc:  # (fail closed: the connection ends, audited)
                log.error("mitmproxy engine: %s; closing the connection handed to it", exc)
                writer.close()
                peer = writer.get_extra_info("peername")
                if peer is not None:
                    self._abandoned((str(peer[0]), int(peer[1])))
                return
            await server.handle_stream(reader, writer)

        return handle_stream

    def shutdown(self) -> None:
        if self.master is not None:
            self.master.shutdown()
