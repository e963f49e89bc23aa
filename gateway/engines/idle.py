"""mitmproxy engine: close upstream connections of intercepted tunnels that sit idle.

An idle intercepted tunnel holds two TLS connections; the upstream one is the half the
gateway can drop without the sandbox noticing: mitmproxy opens a new one on the next
request. After `network.upstream_idle_timeout` seconds with no request in flight, the
upstream connection is closed (WebSocket connections count as in flight until they end).
Passthrough and raw TCP tunnels are never touched: they carry no HTTP flows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from mitmproxy import connection, http
from mitmproxy.proxy import server_hooks

from gateway.engines.patches import close_mitmproxy_server

log = logging.getLogger("sandbox_gateway")


@dataclass
class _Use:
    """HTTP use of one client connection (tunnel) and the upstream it last used."""

    server: object | None = None
    inflight: int = 0
    last: float = 0.0


class IdleUpstreams:
    """Tracks, per client connection, HTTP flows in flight; closes idle upstreams."""

    def __init__(self, timeout: float, proxyserver: Any = None) -> None:
        self.timeout = timeout
        self.proxyserver = proxyserver  # the gateway's own Proxyserver addon
        self._uses: dict[str, _Use] = {}
        self._task: asyncio.Task[None] | None = None

    async def done(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if self.timeout <= 0 or flow.response is not None:
            return
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._sweep())
        use = self._uses.setdefault(flow.client_conn.id, _Use())
        use.inflight += 1

    def response(self, flow: http.HTTPFlow) -> None:
        if flow.websocket is None:  # a WebSocket stays in flight until websocket_end
            self._finished(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._finished(flow)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        self._finished(flow)

    def _finished(self, flow: http.HTTPFlow) -> None:
        use = self._uses.get(flow.client_conn.id)
        if use is not None:
            use.inflight = max(0, use.inflight - 1)
            use.last = time.monotonic()
            if flow.server_conn is not None and flow.server_conn.connected:
                use.server = flow.server_conn

    def server_disconnected(self, data: server_hooks.ServerConnectionHookData) -> None:
        use = self._uses.get(data.client.id)
        if use is not None and use.server is data.server:
            use.server = None

    def client_disconnected(self, client: connection.Client) -> None:
        self._uses.pop(client.id, None)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(max(0.5, self.timeout / 4))
            try:
                self._close_idle()
            except Exception:  # never let one bad entry stop the sweeping
                log.exception("closing idle upstream connections failed")

    def _close_idle(self) -> None:
        now = time.monotonic()
        for client_id, use in list(self._uses.items()):
            if use.server is None or use.inflight or now - use.last < self.timeout:
                continue
            server, use.server = use.server, None
            if self.proxyserver is not None:
                close_mitmproxy_server(self.proxyserver, client_id, server)
