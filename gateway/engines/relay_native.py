"""Passthrough tunnels relayed off the event loop, by the native thread of `_relay.c`.

`KernelRelay` (splice_kernel.py) moves a tunnel's bytes with one loop callback per
readiness event: for a small request and its answer that is two passes through
asyncio's selector, about 20 µs of user time a request where squid spends 7 (measured
quiet, bench's passthrough row: 35.5-36.1 µs of CPU a request in all against squid's
25.1-25.6, and 24.8-25.1 on this thread; docs/performance.md, "A relay in C").
`Relays` hands the tunnel's two descriptors to one C thread per
process instead, which relays them with the same rules (small reads through a buffer,
bulk ones spliced through a pipe, back-pressure, half-closes) and tells the loop only
that a tunnel ended: an eventfd the loop watches becomes readable, and `_reap` calls the
tunnel's `on_done`.

`NativeRelay` has `KernelRelay`'s interface (`start`, `bytes_out`, `bytes_in`, `last`,
`close`, `on_done`), so `engines/splice.py` uses whichever is available: this one where
the extension was built (Linux with a C compiler at install time), the loop's elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Protocol

__all__ = ["AVAILABLE", "NativeRelay", "Relays"]

log = logging.getLogger("sandbox_gateway")


class _Tunnel(Protocol):
    id: int

    def close(self) -> None: ...
    def counts(self) -> tuple[int, int, float, bool]: ...


class _Relayer(Protocol):
    def add(self, client: int, upstream: int, client_ended: bool = ...) -> _Tunnel: ...
    def reap(self) -> list[int]: ...
    def fileno(self) -> int: ...
    def stats(self) -> tuple[int, int, int]: ...
    def stop(self) -> None: ...


try:
    from gateway.engines import _relay  # type: ignore[attr-defined]
except ImportError:  # (not built here: no C compiler at install time, or not Linux)
    _relay = None

AVAILABLE = _relay is not None


class Relays:
    """The process's relay thread (started at the first tunnel), and the tunnels it
    runs, by id, until each ends or is closed."""

    def __init__(self) -> None:
        self._relayer: _Relayer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.live: dict[int, NativeRelay] = {}

    def relay(self, client: socket.socket, upstream: socket.socket,
              on_done: Callable[[], None]) -> NativeRelay:
        """A relay of `client` <-> `upstream` (connected sockets, given up to it)."""
        return NativeRelay(self, client, upstream, on_done)

    def _add(self, relay: NativeRelay, client: int, upstream: int,
             client_ended: bool) -> _Tunnel:
        if self._relayer is None:
            assert _relay is not None
            self._relayer = _relay.Relayer()
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._relayer.fileno(), self._reap)
        tunnel = self._relayer.add(client, upstream, client_ended)
        self.live[tunnel.id] = relay
        return tunnel

    def _reap(self) -> None:
        """The loop's reader callback: tell the owners of the tunnels that ended."""
        assert self._relayer is not None
        for ended in self._relayer.reap():
            relay = self.live.pop(ended, None)
            if relay is None:  # (closed by its owner meanwhile)
                continue
            try:
                relay.on_done()
            except Exception:
                log.exception("ending a relayed tunnel failed")

    def stats(self) -> tuple[int, int, int]:
        """(running tunnels, reads through the buffer, reads through a pipe)."""
        return (0, 0, 0) if self._relayer is None else self._relayer.stats()

    def stop(self) -> None:
        """Close every tunnel and end the thread (shutdown)."""
        for relay in list(self.live.values()):
            relay.close()
        relayer, self._relayer = self._relayer, None
        if relayer is not None:
            assert self._loop is not None
            self._loop.remove_reader(relayer.fileno())
            relayer.stop()


class NativeRelay:
    """One tunnel on the relay thread; `KernelRelay`'s interface."""

    def __init__(self, relays: Relays, client: socket.socket, upstream: socket.socket,
                 on_done: Callable[[], None]) -> None:
        self.relays = relays
        self.on_done = on_done
        self._sockets: tuple[socket.socket, socket.socket] | None = (client, upstream)
        self._tunnel: _Tunnel | None = None
        self.closed = False

    def start(self, *, client_ended: bool = False) -> None:
        """Hand both descriptors to the thread (`client_ended`: the client had sent its
        EOF already)."""
        assert self._sockets is not None
        client, upstream = self._sockets
        self._sockets = None
        self._tunnel = self.relays._add(self, client.detach(), upstream.detach(),
                                        client_ended)

    def _counts(self) -> tuple[int, int, float, bool]:
        assert self._tunnel is not None
        return self._tunnel.counts()

    @property
    def bytes_out(self) -> int:
        return 0 if self._tunnel is None else self._counts()[0]

    @property
    def bytes_in(self) -> int:
        return 0 if self._tunnel is None else self._counts()[1]

    @property
    def last(self) -> float:
        """The monotonic time of the last bytes read (the owner's idle timeout)."""
        return 0.0 if self._tunnel is None else self._counts()[2]

    def close(self) -> None:
        """Stop relaying and close both sockets (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self._sockets is not None:
            for sock in self._sockets:
                sock.close()
            self._sockets = None
        if self._tunnel is not None:
            self.relays.live.pop(self._tunnel.id, None)
            self._tunnel.close()
