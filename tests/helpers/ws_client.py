"""The tests' WebSocket client: websockets' sync client whose every wait ends.

websockets' sync client reads its socket in a thread of its own. When the opening
handshake gets no answer in `open_timeout`, it closes the socket and joins that thread,
with no timeout; but a thread blocked in a read of a TLS record that never completes (a
TLS 1.3 session ticket, or part of a record, made the socket readable) is not woken by
closing the file descriptor: the join waited for the peer forever, and a gateway that
did not answer an upgrade hung a test until pytest-timeout's 120 s instead of failing
it in 10 s. Here the socket is shut down before it is closed (`close_socket`), which
wakes that read, and every blocking read and write of the socket has a timeout
(`IO_TIMEOUT`): a silent peer is a `TimeoutError` or a `ConnectionClosed` in seconds.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

from websockets.sync.client import ClientConnection
from websockets.sync.client import connect as _connect

__all__ = ["IO_TIMEOUT", "OPEN_TIMEOUT", "BoundedConnection", "connect"]

OPEN_TIMEOUT = 10.0  # seconds for TCP, CONNECT, TLS and the upgrade's answer, together
# Seconds one read or write of the socket may block. Longer than the keepalive: a live
# connection that carries nothing still gets the pongs of the client's pings (every
# 20 s by default), so only a peer that answers nothing at all runs into it.
IO_TIMEOUT = 30.0


class BoundedConnection(ClientConnection):
    """websockets' client connection whose socket reads and writes time out and whose
    close wakes a read in progress (see the module docstring)."""

    io_timeout = IO_TIMEOUT

    def __init__(self, sock: socket.socket, *args: Any, **kwargs: Any) -> None:
        sock.settimeout(self.io_timeout)
        super().__init__(sock, *args, **kwargs)

    def close_socket(self) -> None:
        with contextlib.suppress(OSError):  # (not connected any more: nothing to wake)
            self.socket.shutdown(socket.SHUT_RDWR)
        super().close_socket()


def connect(uri: str, *, open_timeout: float = OPEN_TIMEOUT, **kwargs: Any
            ) -> ClientConnection:
    """`websockets.sync.client.connect` with `BoundedConnection`: the same arguments."""
    kwargs.setdefault("create_connection", BoundedConnection)
    return _connect(uri, open_timeout=open_timeout, **kwargs)
