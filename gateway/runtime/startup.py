"""What a gateway process takes from the system at start, and the error that stops it:
its listening sockets (`bind`), its open-files limit, the descriptors it holds."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
from typing import TYPE_CHECKING

from gateway.config import HostPort

if TYPE_CHECKING:

    pass


__all__ = ["BACKLOG", "FD_RESERVE", "StartupError", "bind", "open_fds", "raise_fd_limit"]


BACKLOG = 1024
FD_RESERVE = 64  # descriptors kept for files, DNS, the admin API, Redis


class StartupError(RuntimeError):
    """The gateway cannot start; the message says what to fix."""


def bind(hp: HostPort, *, shared: bool = False) -> socket.socket:
    """A listening socket on `hp`. Alone, the port is exclusively ours (another instance
    on it is a start-up error naming the address); `shared` (worker processes of one
    supervisor, which reserved the port) uses SO_REUSEPORT. Made as TCP by name
    (IPPROTO_TCP), as asyncio's own listeners are: asyncio sets TCP_NODELAY only on a
    connection whose socket says so, and without it an answer written in two parts (a
    head, then its body) waited for the client's delayed ACK, 40 ms, on every request
    after a connection's first few."""
    family = socket.AF_INET6 if ":" in hp.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((hp.host, hp.port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {hp}: {exc.strerror} (is another gateway "
                           "or program serving it?)") from None
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


def raise_fd_limit() -> int:
    """Raise the open-files soft limit to the hard limit; returns the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return int(soft)


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0
