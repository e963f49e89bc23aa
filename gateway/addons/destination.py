"""Step 2, destination: resolve, refuse forbidden addresses, connect to what was checked.

Allowed destinations are resolved once per connection and host (after the policy
allowed them: denied names are never even looked up), checked against the address
rules, and pinned: the connection is made to the checked IP, so a DNS answer that
changes in between (rebinding) cannot reach anything else. `server_connect` re-checks
whatever mitmproxy is about to dial and refuses it if it has no clean check.
"""

from __future__ import annotations

from mitmproxy import http
from mitmproxy.proxy import server_hooks

from gateway import metrics
from gateway.addons.common import IDENTITY, Sessions, fail_closed, refuse
from gateway.addons.local_api import INTERNAL_HOST
from gateway.audit import Auditor
from gateway.destination import normalize_host
from gateway.errors import Refusal
from gateway.resolver import DestinationGuard, DestinationRefused, pin


class Destinations:
    """Checks and pins upstream addresses, per client connection."""

    def __init__(self, guard: DestinationGuard, sessions: Sessions, auditor: Auditor) -> None:
        self.guard = guard
        self.sessions = sessions
        self.auditor = auditor

    async def _check(self, flow: http.HTTPFlow, host: str, port: int) -> None:
        pinned = self.sessions.get(flow.client_conn).pinned
        if (host, port) in pinned:
            return
        try:
            pinned[(host, port)] = await self.guard.check(host, port)
        except DestinationRefused as refused:
            metrics.DESTINATIONS_REFUSED.labels(code=refused.code).inc()
            refusal = Refusal(refused.code, refused.reason)
            refuse(flow, refusal)
            self.auditor.refused(flow, refusal, flow.metadata.get(IDENTITY), host, port)

    @fail_closed
    async def http_connect(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        session = self.sessions.get(flow.client_conn)
        assert session.tunnel is not None, "an allowed CONNECT always has a tunnel"
        if session.tunnel.host == INTERNAL_HOST:
            return  # served by the gateway itself (LocalApi); never dialled
        await self._check(flow, session.tunnel.host, session.tunnel.port)
        if flow.response is not None:
            session.tunnel = None

    @fail_closed
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        session = self.sessions.peek(flow.client_conn)
        if session is not None and session.tunnel is not None:
            return  # checked at CONNECT
        await self._check(flow, normalize_host(flow.request.host), flow.request.port)

    @fail_closed
    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        address = data.server.address
        if address is None:
            data.server.error = "refused: no destination"
            return
        host, port = normalize_host(str(address[0])), int(address[1])
        pinned = self.sessions.get(data.client).pinned
        checked = pinned.get((host, port))
        if checked is None:
            try:
                checked = pinned[(host, port)] = await self.guard.check(host, port)
            except DestinationRefused as refused:
                metrics.DESTINATIONS_REFUSED.labels(code=refused.code).inc()
                data.server.error = f"refused: {refused.reason}"
                return
        pin(checked)
