"""Bounds on the admin listener: every wait has a deadline, a body has a size limit, the
listener a connection cap.

uvicorn bounds only the wait between kept-alive requests, and only until a byte
arrives: a partial head, bytes that never make one, or a body announced and never sent
held the connection (and a descriptor of the proxy's budget) for good. Here:

- the request head, from the connection (or the first byte after a response):
  `admin.timeouts.head`, then `408 request_timeout` and closed;
- the request body, from the head to its end: `admin.timeouts.body`, likewise;
- a kept-alive connection with no request, a response the client does not read:
  `admin.timeouts.idle`, then closed;
- a body larger than `admin.max_body` (announced, or counted as it arrives): `413
  body_too_large`, closed; a head larger than 16 KiB: `400` (uvicorn's h11);
- a chunk size past 63 bits (`400 bad_request`, as on the proxy port) or past
  `admin.max_body` (`413`): refused as soon as the size is read, not after the body
  timeout (h11 takes up to 20 hex digits and waits for that many bytes); a chunk size
  that is not hex, or longer than 20 digits, is h11's `400` at once;
- connections past `admin.max_connections`: read only for a probe (`api/probes.py`:
  `/healthz` and `/readyz` are answered; anything else `503 too_many_connections`),
  closed.

Answers take the admin API's error shape and name the phase that timed out.
`Bounds.protocol` is the protocol class uvicorn runs (`uvicorn.Config(http=...)`): it
wraps uvicorn's own HTTP/1 protocol (`h11_impl.H11Protocol`, the `http="h11"` choice)
through the asyncio protocol interface only, and keeps the timers. `Bounds.wrap(app)`
wraps the ASGI app: it reads a body (bounded) before the app sees it and tells the
protocol where the request is (head read, body read, response sent).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any, ClassVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.api.errors import raw_error
from gateway.api.probes import Answer, ProbeReader, Reserve
from gateway.config import AdminConfig

__all__ = ["MAX_HEAD", "Bounds"]

log = logging.getLogger("sandbox_gateway")

MAX_HEAD = 16 * 1024  # h11's incomplete-event limit: a larger head is a 400 at once


def _error(status: int, code: str, reason: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = json.dumps({"error": code, "reason": reason}).encode()
    return [(b"content-type", b"application/json"),
            (b"x-sandbox-gateway-error", code.encode()),
            (b"content-length", str(len(body)).encode()), (b"connection", b"close")], body


class Bounds:
    """The admin listener's bounds (see the module docstring)."""

    def __init__(self, config: AdminConfig, *, probe: Callable[[str], Answer | None],
                 chunk_left: Callable[[Any], int], max_chunk: int) -> None:
        self.config = config
        # The chunk uvicorn's h11.Connection is reading, and the largest chunk size any
        # HTTP/1 body may announce (engines/patches.py: the proxy port's rule).
        self.chunk_left, self.max_chunk = chunk_left, max_chunk
        self.open: dict[tuple[str, int], _Guard] = {}
        # past the cap: probes answered (`probe`: a path's answer, None for another)
        self.reserve = Reserve(probe, config.max_connections)
        self.protocol: type[asyncio.Protocol] = type("AdminProtocol", (_Guard,),
                                                     {"bounds": self})

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """The ASGI app behind the bounds: bodies read (bounded) before `app` runs."""
        bounds = self

        async def bounded(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            client = scope.get("client")
            guard = bounds.open.get((str(client[0]), int(client[1]))) if client else None
            if guard is None:  # (not through the protocol: a test client) unbounded
                await app(scope, receive, send)
                return
            await guard.serve(app, scope, receive, send)

        return bounded

    def close(self) -> None:
        """Close the connections past the cap still waiting for a probe request (the
        gateway stops; uvicorn closes its own)."""
        self.reserve.close()


class _Guard(asyncio.Protocol):
    """One admin connection: uvicorn's protocol inside, the deadlines around it."""

    bounds: ClassVar[Bounds]

    def __init__(self, **uvicorn: Any) -> None:
        self.inner = H11Protocol(**uvicorn)
        self.transport: asyncio.Transport | None = None
        self.peer: tuple[str, int] | None = None
        self.phase = "head"  # head, body, app (the handler runs), idle
        self.responding = False  # a response has started: no 408 then
        self.timer: asyncio.TimerHandle | None = None
        self.write_timer: asyncio.TimerHandle | None = None
        self.probe: ProbeReader | None = None  # past the cap: the reserve's reader (api/probes.py)

    # -- the transport's protocol -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if len(self.bounds.open) >= self.bounds.config.max_connections:
            self.probe = self.bounds.reserve.admit(transport)
            return
        peer = transport.get_extra_info("peername") or ("?", 0)
        self.peer = (str(peer[0]), int(peer[1]))
        self.bounds.open[self.peer] = self
        self.inner.connection_made(transport)
        self._arm("head")

    def data_received(self, data: bytes) -> None:
        if self.peer is None:
            if self.probe is not None:
                self.probe.data_received(data)
            return
        if self.phase == "idle":
            self._arm("head")  # the next request's first byte: its head is timed now
        self.inner.data_received(data)
        left = self.bounds.chunk_left(self.inner.conn)
        if left > self.bounds.config.max_body and not self.responding:
            self._bad_chunk(left)

    def eof_received(self) -> bool | None:
        if self.peer is None:
            if self.probe is not None:
                self.probe.eof_received()
            return None
        self.inner.eof_received()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.probe is not None:
            self.probe.close()
        self._cancel()
        if self.write_timer is not None:
            self.write_timer.cancel()
        if self.peer is not None:
            self.bounds.open.pop(self.peer, None)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()
        if self.write_timer is None:  # a client that does not read its response
            self.write_timer = asyncio.get_running_loop().call_later(
                self.bounds.config.timeouts.idle, self._expired, "response")

    def resume_writing(self) -> None:
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None
        self.inner.resume_writing()

    # -- deadlines ----------------------------------------------------------------------------

    def _arm(self, phase: str) -> None:
        self._cancel()
        self.phase = phase
        if phase in ("head", "body", "idle"):
            timeout = getattr(self.bounds.config.timeouts, phase)
            self.timer = asyncio.get_running_loop().call_later(timeout, self._expired, phase)

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self, phase: str) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        timeouts = self.bounds.config.timeouts
        what = {"head": f"the request head did not arrive within {timeouts.head:g}s "
                        "(admin.timeouts.head)",
                "body": f"the request body did not arrive within {timeouts.body:g}s "
                        "(admin.timeouts.body)",
                "idle": f"no request within {timeouts.idle:g}s (admin.timeouts.idle)",
                "response": f"the client read none of its response for {timeouts.idle:g}s "
                            "(admin.timeouts.idle)"}[phase]
        log.debug("admin connection from %s closed: %s", self.peer, what)
        if phase in ("head", "body") and not self.responding:
            transport.write(raw_error(408, "Request Timeout", "request_timeout", what))
        transport.close()

    def _bad_chunk(self, size: int) -> None:
        """A chunk size no body here may have, refused now rather than waited for."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self._cancel()
        if size > self.bounds.max_chunk:  # (the proxy port's rule, engines/patches.py)
            transport.write(raw_error(400, "Bad Request", "bad_request",
                                      "chunk size too large (more than 63 bits): the "
                                      "chunked request body is malformed"))
        else:
            limit = self.bounds.config.max_body
            transport.write(raw_error(413, "Content Too Large", "body_too_large",
                                      f"a chunk of the request body is larger than "
                                      f"{limit} bytes (admin.max_body)"))
        transport.close()

    # -- one request (called by the wrapped app) ----------------------------------------------

    async def serve(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """Run `app` for one request: its body read first (bounded in time and size),
        the protocol told when the response has gone."""
        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.responding = True
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                self.responding = False
                self._arm("idle")

        length, chunked = None, False
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = int(value) if value.isdigit() else None
            elif name == b"transfer-encoding":
                chunked = True
        if not chunked and not length:
            self._arm("app")
            await app(scope, receive, tracked)
            return
        limit = self.bounds.config.max_body
        if length is not None and length > limit:
            await self._too_large(tracked, limit)
            return
        self._arm("body")
        pieces, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left (or the body timed out): nothing to answer
            pieces.append(message.get("body", b""))
            size += len(pieces[-1])
            if size > limit:
                await self._too_large(tracked, limit)
                return
            if not message.get("more_body"):
                break
        self._arm("app")
        body: list[Message] = [{"type": "http.request", "body": b"".join(pieces),
                                "more_body": False}]

        async def replay() -> Message:
            return body.pop() if body else await receive()

        await app(scope, replay, tracked)

    async def _too_large(self, send: Send, limit: int) -> None:
        headers, body = _error(413, "body_too_large", f"the request body is larger than "
                               f"{limit} bytes (admin.max_body)")
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
