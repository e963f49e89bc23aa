"""WebSocket relay for the HTTP/1 intercept path, with mitmproxy's WebSocket hooks.

After a `101` that upgrades to WebSocket, messages are parsed on both sides (wsproto,
permessage-deflate negotiated as the server answered), each complete message is put on
`flow.websocket.messages` and the `websocket_message` hooks run (Inject refuses leaks
and redacts echoed keys, Record counts and forgets it) before it is re-framed to the
other side — exactly as mitmproxy's WebSocket layer does, so the same addons decide.
A message an addon dropped is not sent; a killed flow closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import wsproto
import wsproto.events
import wsproto.extensions
import wsproto.handshake
import wsproto.utilities
from mitmproxy import http, websocket
from mitmproxy.proxy.layers.websocket import Fragmentizer
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.frame_protocol import Opcode
from wsproto.utilities import LocalProtocolError

if TYPE_CHECKING:
    from gateway.intercept import InterceptedTunnel, _Side, _Upstream


def is_websocket(f: http.HTTPFlow) -> bool:
    """The upgrade mitmproxy would relay as WebSocket."""
    assert f.response is not None
    return (f.response.status_code == 101
            and f.response.headers.get("upgrade", "").lower() == "websocket"
            and f.request.headers.get("Sec-WebSocket-Version", "").encode()
            == wsproto.handshake.WEBSOCKET_VERSION)


def _extensions(f: http.HTTPFlow) -> list[wsproto.extensions.Extension]:
    assert f.response is not None
    header = f.response.headers.get("Sec-WebSocket-Extensions", "")
    found: list[wsproto.extensions.Extension] = []
    for ext in wsproto.utilities.split_comma_header(header.encode("ascii", "replace")):
        if ext.split(";", 1)[0].strip() == wsproto.extensions.PerMessageDeflate.name:
            deflate = wsproto.extensions.PerMessageDeflate()
            deflate.finalize(ext)
            found.append(deflate)
    return found


class _Relay:
    def __init__(self, tunnel: InterceptedTunnel, upstream: _Upstream, f: http.HTTPFlow) -> None:
        self.tunnel = tunnel
        self.upstream = upstream
        self.flow = f
        self.client_ws = Connection(ConnectionType.SERVER, _extensions(f))
        self.server_ws = Connection(ConnectionType.CLIENT, _extensions(f))
        self.closed = False
        # fragments of the message being received, per direction (from_client)
        self.frames: dict[bool, list[bytes]] = {True: [b""], False: [b""]}

    async def pump(self, from_client: bool) -> None:
        side: _Side = self.tunnel if from_client else self.upstream
        src = self.client_ws if from_client else self.server_ws
        while not self.closed:
            if len(side.buf):
                src.receive_data(bytes(side.buf.maybe_extract_at_most(len(side.buf)) or b""))
            elif side.eof:
                src.receive_data(None)
            else:
                await side.more()
                continue
            await self._events(from_client)
            if side.eof and not len(side.buf):
                return

    async def _events(self, from_client: bool) -> None:
        src, dst = ((self.client_ws, self.server_ws) if from_client
                    else (self.server_ws, self.client_ws))
        out: _Side = self.upstream if from_client else self.tunnel
        frames = self.frames[from_client]
        assert self.flow.websocket is not None
        hooks = self.tunnel.engine.hooks
        for event in src.events():
            if isinstance(event, wsproto.events.Message):
                is_text = isinstance(event.data, str)
                frames[-1] += event.data.encode() if isinstance(event.data, str) else event.data
                if event.message_finished:
                    content = b"".join(frames)
                    fragmentizer = Fragmentizer(frames, is_text)
                    frames = self.frames[from_client] = [b""]
                    message = websocket.WebSocketMessage(
                        Opcode.TEXT if is_text else Opcode.BINARY, from_client, content)
                    self.flow.websocket.messages.append(message)
                    await hooks("websocket_message", self.flow)
                    if self.flow.error is not None:  # killed: a leak was refused
                        self.closed = True
                        return
                    if not message.dropped:
                        for part in fragmentizer(message.content):
                            await out.send(dst.send(part))
                elif event.frame_finished:
                    frames.append(b"")
            elif isinstance(event, (wsproto.events.Ping, wsproto.events.Pong)):
                await out.send(dst.send(event))
            elif isinstance(event, wsproto.events.CloseConnection):
                ws = self.flow.websocket
                ws.timestamp_end = time.time()
                ws.closed_by_client = from_client
                ws.close_code = event.code
                ws.close_reason = event.reason
                for conn, side in ((self.server_ws, self.upstream), (self.client_ws, self.tunnel)):
                    if conn.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
                        with contextlib.suppress(ConnectionError, LocalProtocolError):
                            await side.send(conn.send(event))
                self.closed = True
                return


async def relay(tunnel: InterceptedTunnel, upstream: _Upstream, f: http.HTTPFlow) -> None:
    """Relay messages until either side closes; the tunnel ends with the WebSocket."""
    hooks = tunnel.engine.hooks
    r = _Relay(tunnel, upstream, f)
    await hooks("websocket_start", f)
    tasks = [asyncio.create_task(r.pump(True)), asyncio.create_task(r.pump(False))]
    try:
        _done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        r.closed = True
        for task in pending:
            task.cancel()
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                exc = task.exception()
                if not isinstance(exc, (ConnectionError, wsproto.utilities.RemoteProtocolError)):
                    raise exc  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        assert f.websocket is not None
        if f.websocket.timestamp_end is None:
            f.websocket.timestamp_end = time.time()
        await hooks("websocket_end", f)
        f.live = False
