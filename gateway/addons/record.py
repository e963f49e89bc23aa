"""Step 7, record: stream responses through, count their bytes, write the audit line.

Responses are always streamed (`flow.response.stream`): the sandbox gets every chunk
as soon as the upstream sends it, and memory stays flat for large downloads. The
callable sees each chunk once, which is where bytes are counted. Passthrough tunnels
are recorded when they close.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from mitmproxy import connection, http

from gateway import metrics
from gateway.addons.common import (
    AUDITED,
    BYTES_IN,
    CREDENTIAL,
    DECISION,
    IDENTITY,
    PATH,
    REFUSAL,
    Sessions,
)
from gateway.audit import Auditor
from gateway.policy import Decision

Chunks = bytes | Iterable[bytes]
ChunkFilter = Callable[[bytes], Chunks]


class Record:
    """Audits completed requests and passthrough tunnels."""

    def __init__(self, sessions: Sessions, auditor: Auditor) -> None:
        self.sessions = sessions
        self.auditor = auditor

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if REFUSAL in flow.metadata or flow.response is None:
            return
        previous = flow.response.stream
        counter = _Counter(flow)
        if callable(previous):
            inner: ChunkFilter = previous
            flow.response.stream = lambda chunk: counter(inner(chunk))
        else:
            flow.response.stream = counter

    def response(self, flow: http.HTTPFlow) -> None:
        self._complete(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._complete(flow)

    def _complete(self, flow: http.HTTPFlow) -> None:
        if (REFUSAL in flow.metadata or flow.metadata.get(AUDITED)
                or flow.request.method == "CONNECT"):
            return
        decision: Decision | None = flow.metadata.get(DECISION)
        if decision is None:
            return
        flow.metadata[AUDITED] = True
        session = self.sessions.peek(flow.client_conn)
        tunnel = session.tunnel if session is not None else None
        host = tunnel.host if tunnel else flow.request.host
        port = tunnel.port if tunnel else flow.request.port
        bytes_in = int(flow.metadata.get(BYTES_IN, 0))
        metrics.child(metrics.BYTES, "in").inc(bytes_in)
        self.auditor.completed(
            flow, flow.metadata.get(IDENTITY), decision.result, decision.reason,
            decision.rule.source if decision.rule else None, host, port, bytes_in,
            flow.metadata.get(PATH, "intercept"), flow.metadata.get(CREDENTIAL),
        )

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        """Relay frames, never keep them: mitmproxy stores every message by default."""
        assert flow.websocket is not None
        metrics.BYTES.labels(direction="websocket").inc(len(flow.websocket.messages[-1].content))
        flow.websocket.messages.clear()

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        self._complete(flow)

    def client_disconnected(self, client: connection.Client) -> None:
        session = self.sessions.drop(client)
        if session is None or session.tunnel is None or not session.tunnel.passthrough:
            return
        tunnel, decision = session.tunnel, session.tunnel.decision
        if decision is None:
            return
        self.auditor.passthrough_closed(session.identity, decision, client.peername,
                                        tunnel.host, tunnel.port, tunnel.started, None, None)


class _Counter:
    """Counts streamed body bytes into the flow's metadata."""

    __slots__ = ("flow",)

    def __init__(self, flow: http.HTTPFlow) -> None:
        self.flow = flow
        flow.metadata[BYTES_IN] = 0

    def __call__(self, chunk: Chunks) -> Chunks:
        if isinstance(chunk, bytes):
            self.flow.metadata[BYTES_IN] += len(chunk)
        else:
            chunk = list(chunk)
            self.flow.metadata[BYTES_IN] += sum(len(c) for c in chunk)
        return chunk
