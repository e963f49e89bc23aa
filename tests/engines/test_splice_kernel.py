"""The kernel relay (engines/splice_kernel.py) between real TCP sockets on 127.0.0.1:
bytes arrive whole and in order both ways at once, a slow reader holds the other side
back (one pipe at most), EOFs pass on as half-closes, a reset ends the relay once, small
exchanges go through the loop's buffer and bulk ones through a pipe, and no descriptor
is left behind."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import resource
import socket
import struct

import pytest
from helpers.relay_sockets import fds, pair, read_all, read_n, send

from gateway.engines import splice_kernel
from gateway.engines.splice_kernel import AVAILABLE, PIPE_SIZE, KernelRelay, Pipes

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="os.splice is Linux-only")

SIZE = 24 * 1024 * 1024


class Ends:
    """sandbox <-> [client | relay | upstream] <-> server."""

    def __init__(self, mss: int | None = None) -> None:
        self.sandbox, self.client = pair()
        self.upstream, self.server = pair(mss)  # (mss: helpers/relay_sockets.py)
        self.pipes = Pipes()
        self.done = 0
        self.relay = KernelRelay(self.client, self.upstream, self.pipes, self._done)

    def _done(self) -> None:
        self.done += 1

    def close(self) -> None:
        self.relay.close()
        self.pipes.clear()
        self.sandbox.close()
        self.server.close()


def test_bytes_arrive_whole_both_ways_at_once_and_eofs_pass_on() -> None:
    async def main() -> None:
        before = fds()
        ends = Ends()
        ends.relay.start()
        up, down = os.urandom(SIZE), os.urandom(SIZE // 3)
        _, _, at_server, at_sandbox = await asyncio.wait_for(asyncio.gather(
            send(ends.sandbox, up), send(ends.server, down),
            read_all(ends.server, slow=True), read_all(ends.sandbox)), 60)
        assert hashlib.sha256(at_server).digest() == hashlib.sha256(up).digest()
        assert at_sandbox == down
        assert (ends.relay.bytes_out, ends.relay.bytes_in) == (SIZE, SIZE // 3)
        for _ in range(100):
            if ends.done:
                break
            await asyncio.sleep(0.01)
        assert ends.done == 1 and ends.relay.closed
        assert ends.relay.out.pipe is None and ends.relay.into.pipe is None
        assert len(ends.pipes.free) <= Pipes.KEEP
        ends.close()
        assert fds() == before

    asyncio.run(main())


def test_a_half_closed_sandbox_still_gets_the_whole_answer() -> None:
    """The sandbox sends its request and EOF first (curl -T, a git push); the answer
    keeps coming after the upstream has read that EOF."""
    async def main() -> None:
        ends = Ends()
        ends.relay.start()
        await send(ends.sandbox, b"request")
        assert await asyncio.wait_for(read_all(ends.server), 10) == b"request"
        answer = os.urandom(3 * PIPE_SIZE + 17)
        await send(ends.server, answer)
        assert await asyncio.wait_for(read_all(ends.sandbox), 10) == answer
        await asyncio.sleep(0.05)
        assert ends.done == 1
        ends.close()

    asyncio.run(main())


def test_a_client_that_ended_before_the_relay_began_is_passed_on_at_once() -> None:
    async def main() -> None:
        ends = Ends()
        ends.sandbox.shutdown(socket.SHUT_WR)
        ends.relay.start(client_ended=True)
        assert await asyncio.wait_for(read_all(ends.server), 10) == b""
        await send(ends.server, b"bye")
        assert await asyncio.wait_for(read_all(ends.sandbox), 10) == b"bye"
        await asyncio.sleep(0.05)
        assert ends.done == 1 and ends.relay.bytes_out == 0
        ends.close()

    asyncio.run(main())


def test_a_reset_ends_the_relay_once_with_nothing_left_open() -> None:
    async def main() -> None:
        before = fds()
        ends = Ends()
        ends.relay.start()
        await send(ends.sandbox, b"x" * 1000, eof=False)
        assert await asyncio.wait_for(asyncio.get_running_loop().sock_recv(ends.server, 10),
                                      5) == b"x" * 10
        # RST from the server side: SO_LINGER 0, then close
        ends.server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        ends.server.close()
        await send(ends.sandbox, b"y" * 100_000, eof=False)
        for _ in range(200):
            if ends.done:
                break
            await asyncio.sleep(0.01)
        assert ends.done == 1 and ends.relay.closed
        # the sandbox's connection ended too (reset: it had sent bytes nobody read)
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(read_all(ends.sandbox), 5) == b""
        ends.relay.close()  # idempotent
        ends.pipes.clear()
        ends.sandbox.close()
        assert fds() == before
        assert ends.done == 1

    asyncio.run(main())


async def _ping_pong(ends: Ends, rounds: int) -> None:
    loop = asyncio.get_running_loop()
    for _ in range(rounds):
        await send(ends.sandbox, b"ping", eof=False)
        assert await asyncio.wait_for(loop.sock_recv(ends.server, 10), 5) == b"ping"
        await send(ends.server, b"pong", eof=False)
        assert await asyncio.wait_for(loop.sock_recv(ends.sandbox, 10), 5) == b"pong"
        assert ends.relay.out.pipe is None and ends.relay.into.pipe is None


def test_an_idle_relay_holds_no_pipe() -> None:
    """Pipes are lent only while bytes are in them: thousands of idle tunnels hold none;
    small exchanges take none at all (the loop's buffer carries them)."""
    async def main() -> None:
        ends = Ends()
        ends.relay.start()
        await _ping_pong(ends, 5)
        assert not ends.pipes.free
        big = os.urandom(4 * PIPE_SIZE)
        await send(ends.server, big, eof=False)
        loop = asyncio.get_running_loop()
        got = bytearray()
        while len(got) < len(big):
            got += await asyncio.wait_for(loop.sock_recv(ends.sandbox, 1 << 20), 5)
        assert got == big
        await _ping_pong(ends, 2)
        assert 1 <= len(ends.pipes.free) <= 2
        ends.close()
        assert not ends.pipes.free

    asyncio.run(main())


def test_small_reads_use_the_buffer_and_a_bulk_transfer_the_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A direction starts on the buffer, turns to splicing when a read fills it, and back
    when a spliced read is small again; the bytes stay whole and in order throughout."""
    spliced: list[int] = []
    real = os.splice

    def counting(*args: object, **kwargs: object) -> int:
        n: int = real(*args, **kwargs)  # type: ignore[arg-type]
        spliced.append(n)
        return n

    monkeypatch.setattr(splice_kernel.os, "splice", counting)

    async def main() -> None:
        ends = Ends()
        ends.relay.start()
        await _ping_pong(ends, 3)
        assert spliced == [] and ends.relay.into.small
        big = os.urandom(8 * PIPE_SIZE)
        _, at_sandbox = await asyncio.wait_for(asyncio.gather(
            send(ends.server, big, eof=False), read_n(ends.sandbox, len(big))), 30)
        assert at_sandbox == big and sum(spliced) > len(big)  # (in and out of a pipe)
        spliced.clear()
        await _ping_pong(ends, 3)  # the first pong is spliced, and turns the way back
        assert 0 < len(spliced) <= 2 and ends.relay.into.small
        assert (ends.relay.bytes_out, ends.relay.bytes_in) == (24, len(big) + 24)
        ends.close()

    asyncio.run(main())


def test_a_small_read_the_destination_cannot_take_whole_waits_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads below the buffer's size into a destination that takes no more: what it did
    not take is kept, reading pauses, and everything arrives in order once it reads."""
    kept: list[int] = []
    real = splice_kernel._Way._send_rest

    def counting(self: splice_kernel._Way) -> None:
        kept.append(len(self.rest))
        real(self)

    monkeypatch.setattr(splice_kernel._Way, "_send_rest", counting)

    async def main() -> None:
        before = fds()
        ends = Ends(mss=1400)  # (a segment the 4 KiB buffer takes: 0.4 s, not 9)
        ends.upstream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        ends.server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        ends.relay.start()
        loop = asyncio.get_running_loop()
        sent = bytearray()
        for i in range(400):  # 1,000-byte writes, a pause between: small reads each
            chunk = bytes([i % 251]) * 1000
            sent += chunk
            await loop.sock_sendall(ends.sandbox, chunk)
            await asyncio.sleep(0.001 if i % 20 else 0.02)
        ends.sandbox.shutdown(socket.SHUT_WR)
        got = await asyncio.wait_for(read_all(ends.server), 30)
        assert got == sent
        assert kept and not ends.relay.out.rest
        for _ in range(100):
            if ends.relay.out.ended:
                break
            await asyncio.sleep(0.01)
        assert ends.relay.out.ended
        ends.close()
        assert fds() == before

    asyncio.run(main())


def test_a_step_that_raises_ends_the_relay_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in a step (any exception, not only a socket's OSError) closes the tunnel:
    a loop callback that raised would stay registered and be called again forever."""
    calls = []

    def broken(self: object) -> None:
        calls.append(1)
        raise RuntimeError("a bug")

    monkeypatch.setattr(splice_kernel._Way, "_read", broken)

    async def main() -> None:
        before = fds()
        ends = Ends()
        ends.relay.start()
        await send(ends.sandbox, b"x", eof=False)
        for _ in range(100):
            if ends.done:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert ends.done == 1 and ends.relay.closed and calls == [1]
        ends.close()
        assert fds() == before

    asyncio.run(main())


def test_a_stalled_reader_costs_no_cpu() -> None:
    """A destination that reads nothing for a while: the relay stops reading (a full
    pipe, or a pipe with no slot left) and waits, instead of being called on a source
    that stays readable; then everything arrives."""
    async def main() -> None:
        ends = Ends()
        ends.relay.start()
        loop = asyncio.get_running_loop()
        big = os.urandom(16 * PIPE_SIZE)
        sender = loop.create_task(send(ends.server, big, eof=False))
        await asyncio.sleep(0.3)  # the pipe and the socket buffers fill
        used = resource.getrusage(resource.RUSAGE_SELF)
        await asyncio.sleep(1.0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime - used.ru_utime) + (after.ru_stime - used.ru_stime)
        assert cpu < 0.2, f"{cpu:.3f}s of CPU while nothing moved"
        assert await asyncio.wait_for(read_n(ends.sandbox, len(big)), 30) == big
        await sender
        ends.close()

    asyncio.run(main())
