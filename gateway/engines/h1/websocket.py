"""WebSocket relay for the HTTP/1 engine, every message checked by the exchange.

After a `101` to WebSocket, messages are parsed on both sides (wsproto, with
permessage-deflate as the server negotiated), each complete message goes through
`Exchange.ws_message` (from the sandbox: refused if it leaks a token or key, which
closes the connection, or refused alone by the metering step or an `mcp:` rule, which
answer the provider's error event or JSON-RPC errors and go on; from the upstream: an
echoed key redacted, an MCP server's message read as the rule says) and is re-framed to
the other side with its original fragmentation. A message larger than
`limits.max_websocket_message` closes the connection with 1009 (message too big):
messages are held whole for the check, so the cap bounds memory.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import wsproto
import wsproto.events
import wsproto.extensions
import wsproto.utilities
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError

from gateway.core.refusal import MessageRefused, Refusal
from gateway.engines import patches
from gateway.pipeline.exchange import Exchange

if TYPE_CHECKING:
    from gateway.engines.h1.side import Side


def _extensions(response_head: Any) -> list[wsproto.extensions.Extension]:
    header = response_head.headers.get("sec-websocket-extensions") or ""
    found: list[wsproto.extensions.Extension] = []
    for ext in wsproto.utilities.split_comma_header(header.encode("ascii", "replace")):
        if ext.split(";", 1)[0].strip() == wsproto.extensions.PerMessageDeflate.name:
            deflate = wsproto.extensions.PerMessageDeflate()
            deflate.finalize(ext)
            found.append(deflate)
    return found


class _Relay:
    def __init__(self, client: Side, upstream: Side, ex: Exchange, head: Any, *,
                 limit: int, idle: float) -> None:
        self.client = client
        self.upstream = upstream
        self.ex = ex
        self.limit = limit
        self.idle = idle
        self.client_ws = Connection(ConnectionType.SERVER, _extensions(head))
        self.server_ws = Connection(ConnectionType.CLIENT, _extensions(head))
        self.closed = False
        self.frames: dict[bool, list[bytes]] = {True: [], False: []}  # by from_client
        self.size: dict[bool, int] = {True: 0, False: 0}

    async def pump(self, from_client: bool) -> None:
        side: Side = self.client if from_client else self.upstream
        src = self.client_ws if from_client else self.server_ws
        while not self.closed:
            if len(side.buf):
                src.receive_data(bytes(side.buf.maybe_extract_at_most(len(side.buf)) or b""))
            elif side.eof:
                src.receive_data(None)
            else:
                await side.more(self.idle, "WebSocket frame")
                continue
            await self._events(from_client)
            if side.eof and not len(side.buf):
                return

    async def _close_both(self, code: int, reason: str) -> None:
        for conn, side in ((self.server_ws, self.upstream), (self.client_ws, self.client)):
            if conn.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
                with contextlib.suppress(ConnectionError, LocalProtocolError):
                    await side.send(conn.send(wsproto.events.CloseConnection(code, reason)))
        self.closed = True

    async def _events(self, from_client: bool) -> None:
        src, dst = ((self.client_ws, self.server_ws) if from_client
                    else (self.server_ws, self.client_ws))
        out: Side = self.upstream if from_client else self.client
        for event in src.events():
            if isinstance(event, wsproto.events.Message):
                is_text = isinstance(event.data, str)
                data = event.data.encode() if isinstance(event.data, str) else event.data
                self.frames[from_client].append(data)
                self.size[from_client] += len(data)
                if self.size[from_client] > self.limit:
                    await self._close_both(CloseReason.MESSAGE_TOO_BIG,
                                           "message larger than the gateway's limit")
                    return
                if not event.message_finished:
                    continue
                frames, self.frames[from_client] = self.frames[from_client], []
                self.size[from_client] = 0
                try:
                    content = self.ex.ws_message(from_client, b"".join(frames))
                except MessageRefused as refused:  # dropped; the sandbox reads why
                    if refused.reply:  # (none for what no answer is owed)
                        await self.client.send(self.client_ws.send(
                            wsproto.events.TextMessage(refused.reply.decode())))
                    continue
                except Refusal as refusal:
                    self.ex.abort(refusal)  # the exchange's audit line is the refusal
                    await self._close_both(CloseReason.POLICY_VIOLATION,
                                           "refused by the sandbox gateway")
                    return
                for part in patches.Fragmentizer(frames, is_text)(content):
                    await out.send(dst.send(part))
            elif isinstance(event, (wsproto.events.Ping, wsproto.events.Pong)):
                await out.send(dst.send(event))
            elif isinstance(event, wsproto.events.CloseConnection):
                for conn, side in ((self.server_ws, self.upstream),
                                   (self.client_ws, self.client)):
                    if conn.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
                        with contextlib.suppress(ConnectionError, LocalProtocolError):
                            await side.send(conn.send(event))
                self.closed = True
                return


async def relay(client: Side, upstream: Side, ex: Exchange, head: Any, *,
                limit: int, idle: float) -> None:
    """Relay messages until either side closes: a message larger than `limit` bytes
    closes both; `idle` seconds without a frame from a side ends its pump."""
    r = _Relay(client, upstream, ex, head, limit=limit, idle=idle)
    tasks = [asyncio.create_task(r.pump(True)), asyncio.create_task(r.pump(False))]
    try:
        _done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        r.closed = True
        for task in pending:
            task.cancel()
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                exc = task.exception()
                if not isinstance(exc, (ConnectionError, TimeoutError,
                                        wsproto.utilities.RemoteProtocolError)):
                    raise exc  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        client.flush()
        upstream.flush()
