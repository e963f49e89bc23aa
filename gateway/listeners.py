"""Listening sockets that several worker processes share (SO_REUSEPORT).

mitmproxy binds its listeners itself (`AsyncioServerInstance.listen` calls
`asyncio.start_server` with no `reuse_port` and a backlog of 100). Worker processes
sharing one port need that call replaced: `share_listeners()` does so for this
process (one mitmproxy Master per process), and `reserve()` holds a port in the
supervisor so every worker binds the same one. The kernel then spreads new
connections over the workers.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from mitmproxy.proxy import mode_servers

BACKLOG = 1024
_original_listen = mode_servers.AsyncioServerInstance.listen


_settings: dict[str, Any] = {"shared": False, "front": None}


async def _listen(self: Any, host: str, port: int) -> list[Any]:
    """mitmproxy's listen, with SO_REUSEPORT for workers and the passthrough fast path
    (`gateway.fastpath`) in front of the regular (HTTPS_PROXY) listener."""
    if self.mode.transport_protocol != "tcp":
        return list(await _original_listen(self, host, port))
    shared = bool(_settings["shared"])
    front = _settings["front"]
    if front is not None and self.mode.type_name == "regular":
        from gateway.fastpath import FrontDoor

        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: FrontDoor(front, self.handle_stream),
                                          host or None, port, reuse_port=shared or None,
                                          backlog=BACKLOG)
        return [server]
    if not shared:
        return list(await _original_listen(self, host, port))
    return [await asyncio.start_server(self.handle_stream, host or None, port,
                                       reuse_port=True, backlog=BACKLOG)]


def install(front: Any = None, shared: bool = False) -> None:
    """Route this process's mitmproxy listeners through `_listen` (one Master per
    process): `front` is the FastPath for the regular listener, `shared` = workers."""
    _settings["front"] = front
    _settings["shared"] = shared
    mode_servers.AsyncioServerInstance.listen = _listen  # type: ignore[method-assign]


def reserve(host: str, port: int) -> socket.socket:
    """Bind (not listen) host:port with SO_REUSEPORT: fixes the port, accepts nothing."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
