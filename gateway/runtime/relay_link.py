"""A worker's end of the supervisor's revocation relay (`relay.py` has the protocol).

Opened at the worker's start, before it serves: the supervisor's snapshot (revocations
the state store does not have yet) and every revocation relayed until the supervisor's
`welcome` are read first. Then revocations other workers take are held here as they
come (`on_revoke`) and acknowledged; this worker's own go out with `broadcast`, which
returns once every other serving worker holds them (or says which did not acknowledge
in time).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
from collections.abc import Callable
from typing import Any

from gateway.runtime.relay import MAX_LINE, RELAY_TIMEOUT, Lines, encode
from gateway.services.identity.revocations import Relayed

__all__ = ["RelayLink"]

log = logging.getLogger("sandbox_gateway")

OPEN_TIMEOUT = 10.0  # seconds for the supervisor's snapshot at start


class RelayLink:
    """See the module docstring; implements `revocations.Relay`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.on_revoke: Callable[[str, float], None] = lambda jti, expires_at: None
        self._waits: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self.gone = False  # the supervisor's end closed (it exited, or dropped this link)
        # At the start: revocations the store does not have yet (this worker writes them),
        # and those other workers took while it started (they write them).
        self.snapshot: list[tuple[str, float]] = []
        self.early: list[tuple[str, float]] = []

    @classmethod
    async def open(cls, fd: int) -> RelayLink:
        """The link on inherited descriptor `fd`, read up to the supervisor's `welcome`
        (`snapshot`, `early`). Raises OSError/ValueError/TimeoutError when it cannot be
        read."""
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock, limit=MAX_LINE)
        link = cls(reader, writer)
        try:
            await asyncio.wait_for(link._greet(), OPEN_TIMEOUT)
        except BaseException:
            await link.close()
            raise
        return link

    async def _greet(self) -> None:
        """The snapshot, `hello`, and what is relayed until the `welcome`."""
        first = await self._next()
        if first is None or first.get("op") != "snapshot":
            raise ValueError("the supervisor's relay sent no snapshot")
        self.snapshot = [(str(jti), float(exp)) for jti, exp in first["revoked"]]
        self._write({"op": "hello"})
        while (message := await self._next()) is not None:
            if message.get("op") == "welcome":
                return
            if message.get("op") == "revoke":
                self.early.append((str(message["jti"]), float(message["exp"])))
                self._write({"op": "ack", "id": message["id"]})
        raise ConnectionError("the supervisor's relay closed before its welcome")

    def start(self, on_revoke: Callable[[str, float], None]) -> None:
        """Follow the supervisor's messages: `on_revoke(jti, expires_at)` for each
        revocation another worker took (then acknowledged)."""
        self.on_revoke = on_revoke
        self._task = asyncio.get_running_loop().create_task(self._follow(), name="relay")

    async def _next(self) -> dict[str, Any] | None:
        line = await self.reader.readline()
        if not line.endswith(b"\n"):
            return None  # (the supervisor is gone)
        messages = Lines().feed(line)
        return messages[0] if messages else None

    async def _follow(self) -> None:
        try:
            while (message := await self._next()) is not None:
                op = message.get("op")
                if op == "revoke":
                    self.on_revoke(str(message["jti"]), float(message["exp"]))
                    self._write({"op": "ack", "id": message["id"]})
                elif op == "done":
                    waiter = self._waits.pop(int(message["id"]), None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(message)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("the supervisor's revocation relay failed: %s", exc)
        self.gone = True
        for waiter in self._waits.values():  # (the supervisor is gone: it stops us too)
            if not waiter.done():
                waiter.set_exception(ConnectionError("the supervisor's relay is closed"))
        self._waits.clear()

    async def broadcast(self, jti: str, expires_at: float) -> Relayed:
        """Relay `jti` to every other worker; their answer (`Relayed`)."""
        if self.gone:
            return Relayed(reached=False)
        ident = next(self._ids)
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waits[ident] = waiter
        try:
            self._write({"op": "revoke", "id": ident, "jti": jti, "exp": expires_at})
            done = await asyncio.wait_for(waiter, RELAY_TIMEOUT + 1.0)
            return Relayed(tuple(int(i) for i in done["held"]),
                           tuple(int(i) for i in done["missing"]))
        except (OSError, TimeoutError, KeyError, TypeError, ValueError) as exc:
            log.error("the supervisor's revocation relay did not answer: %s", exc)
            return Relayed(reached=False)
        finally:
            self._waits.pop(ident, None)

    def stored(self, jti: str) -> None:
        """The revocation is in the state store: the supervisor may forget it."""
        with contextlib.suppress(ConnectionError):  # (gone: nothing to forget)
            self._write({"op": "stored", "jti": jti})

    def _write(self, message: dict[str, Any]) -> None:
        if self.writer.is_closing():
            raise ConnectionError("the supervisor's relay is closed")
        self.writer.write(encode(message))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()
