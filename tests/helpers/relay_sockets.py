"""Real TCP socket pairs on 127.0.0.1 and the asyncio reads and writes that drive a
relay between them (tests/engines/test_splice_kernel.py, test_relay_native.py)."""

from __future__ import annotations

import asyncio
import os
import socket


def fds() -> int:
    """Descriptors this process has open (what a relay must not leave behind)."""
    return len(os.listdir("/proc/self/fd"))


def pair(mss: int | None = None) -> tuple[socket.socket, socket.socket]:
    """Both ends of one TCP connection on 127.0.0.1, non-blocking. `mss`: the segment
    size both ends announce (loopback's is 64 KiB: into a receive buffer of a few KiB
    the sender then sends only when its probe timer fires, ~40 KiB/s; with segments
    that fit it keeps the buffer full at the speed the reader reads)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as server:
        if mss is not None:
            server.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, mss)
        server.bind(("127.0.0.1", 0))
        server.listen()
        outer = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        if mss is not None:
            outer.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, mss)
        outer.connect(server.getsockname())
        inner, _ = server.accept()
    outer.setblocking(False)
    inner.setblocking(False)
    return outer, inner


async def send(sock: socket.socket, data: bytes, *, eof: bool = True) -> None:
    """Send `data` whole, then half-close (`eof`)."""
    await asyncio.get_running_loop().sock_sendall(sock, data)
    if eof:
        sock.shutdown(socket.SHUT_WR)


async def read_all(sock: socket.socket, *, slow: bool = False) -> bytes:
    """Everything until EOF; `slow`: a reader slower than the writer for its first
    4 MiB (back-pressure on the relay)."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    while True:
        chunk = await loop.sock_recv(sock, 65536)
        if not chunk:
            return bytes(got)
        got += chunk
        if slow and len(got) < 4 * 1024 * 1024:
            await asyncio.sleep(0.002)  # a reader slower than the writer: back-pressure


async def read_n(sock: socket.socket, n: int) -> bytes:
    """At least `n` bytes (what arrived with the `n`th)."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    while len(got) < n:
        got += await loop.sock_recv(sock, 1 << 20)
    return bytes(got)
