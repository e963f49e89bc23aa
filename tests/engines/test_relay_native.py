"""The native relay thread (engines/relay_native.py over _relay.c) between real TCP
sockets on 127.0.0.1: bytes whole and in order both ways at once, over hundreds of
tunnels at a time; back-pressure from a slow reader without spinning; EOFs passed on as
half-closes; a reset or an owner's close ends a tunnel once; small exchanges through
the buffer and bulk ones through a pipe; no descriptor left behind."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import resource
import shutil
import socket
import struct
import sys

import pytest
from helpers.relay_sockets import fds, pair, read_all, read_n, send

from gateway.engines.relay_native import AVAILABLE, NativeRelay, Relays

SIZE = 24 * 1024 * 1024
PIPE = 1024 * 1024


def test_the_relay_is_built_where_a_compiler_is() -> None:
    """`pip install` builds the extension where it can (setup.py): on Linux with a C
    compiler a missing one is a broken build, not a fallback to take quietly."""
    if not sys.platform.startswith("linux") or shutil.which("cc") is None:
        pytest.skip("no C compiler here: the loop's relay (splice_kernel) is used")
    assert AVAILABLE


pytestmark_native = pytest.mark.skipif(not AVAILABLE, reason="the extension is not built")


class Ends:
    """sandbox <-> [client | relay thread | upstream] <-> server."""

    def __init__(self, relays: Relays, mss: int | None = None) -> None:
        self.sandbox, client = pair()
        upstream, self.server = pair(mss)  # (mss: helpers/relay_sockets.py)
        self.done = 0
        self.relay: NativeRelay = relays.relay(client, upstream, self._done)

    def _done(self) -> None:
        self.done += 1

    def close(self) -> None:
        self.relay.close()
        self.sandbox.close()
        self.server.close()


async def _until(check: object, seconds: float = 5) -> None:
    for _ in range(int(seconds * 100)):
        if callable(check) and check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within the time")


@pytestmark_native
def test_bytes_arrive_whole_both_ways_at_once_and_eofs_pass_on() -> None:
    async def main() -> None:
        before = fds()
        relays = Relays()
        ends = Ends(relays)
        ends.relay.start()
        up, down = os.urandom(SIZE), os.urandom(SIZE // 3)
        _, _, at_server, at_sandbox = await asyncio.wait_for(asyncio.gather(
            send(ends.sandbox, up), send(ends.server, down),
            read_all(ends.server, slow=True), read_all(ends.sandbox)), 60)
        assert hashlib.sha256(at_server).digest() == hashlib.sha256(up).digest()
        assert at_sandbox == down
        await _until(lambda: ends.done)
        assert (ends.relay.bytes_out, ends.relay.bytes_in) == (SIZE, SIZE // 3)
        assert ends.done == 1 and relays.stats()[0] == 0 and not relays.live
        ends.close()
        relays.stop()
        assert fds() == before

    asyncio.run(main())


@pytestmark_native
def test_hundreds_of_tunnels_at_once_each_whole() -> None:
    """Tunnels of random sizes, both directions at once, on one thread: none mixes with
    another, every one ends once, and the counts are each its own."""
    async def one(relays: Relays, rng: random.Random) -> None:
        ends = Ends(relays)
        ends.relay.start()
        up = os.urandom(rng.choice([1, 300, 5000, 70_000, 600_000]))
        down = os.urandom(rng.choice([0, 200, 64 * 1024, 300_000, 2_000_000]))
        _, _, at_server, at_sandbox = await asyncio.gather(
            send(ends.sandbox, up), send(ends.server, down),
            read_all(ends.server), read_all(ends.sandbox))
        assert at_server == up and at_sandbox == down
        await _until(lambda: ends.done)
        assert (ends.relay.bytes_out, ends.relay.bytes_in) == (len(up), len(down))
        ends.close()

    async def main() -> None:
        before = fds()
        relays = Relays()
        rng = random.Random(7)
        await asyncio.wait_for(asyncio.gather(*(one(relays, rng) for _ in range(300))), 90)
        running, small, spliced = relays.stats()
        assert running == 0 and small > 0 and spliced > 0
        relays.stop()
        assert fds() == before

    asyncio.run(main())


@pytestmark_native
def test_a_half_closed_sandbox_still_gets_the_whole_answer() -> None:
    async def main() -> None:
        relays = Relays()
        ends = Ends(relays)
        ends.relay.start()
        await send(ends.sandbox, b"request")
        assert await asyncio.wait_for(read_all(ends.server), 10) == b"request"
        answer = os.urandom(3 * PIPE + 17)
        await send(ends.server, answer)
        assert await asyncio.wait_for(read_all(ends.sandbox), 10) == answer
        await _until(lambda: ends.done)
        ends.close()
        relays.stop()

    asyncio.run(main())


@pytestmark_native
def test_a_client_that_ended_before_the_relay_began_is_passed_on_at_once() -> None:
    async def main() -> None:
        relays = Relays()
        ends = Ends(relays)
        ends.sandbox.shutdown(socket.SHUT_WR)
        ends.relay.start(client_ended=True)
        assert await asyncio.wait_for(read_all(ends.server), 10) == b""
        await send(ends.server, b"bye")
        assert await asyncio.wait_for(read_all(ends.sandbox), 10) == b"bye"
        await _until(lambda: ends.done)
        assert ends.relay.bytes_out == 0 and ends.relay.bytes_in == 3
        ends.close()
        relays.stop()

    asyncio.run(main())


@pytestmark_native
def test_a_reset_ends_the_tunnel_once_with_nothing_left_open() -> None:
    async def main() -> None:
        before = fds()
        relays = Relays()
        ends = Ends(relays)
        ends.relay.start()
        await send(ends.sandbox, b"x" * 1000, eof=False)
        assert await asyncio.wait_for(asyncio.get_running_loop().sock_recv(ends.server, 10),
                                      5) == b"x" * 10
        ends.server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        ends.server.close()  # RST
        await send(ends.sandbox, b"y" * 100_000, eof=False)
        await _until(lambda: ends.done)
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(read_all(ends.sandbox), 5) == b""
        ends.relay.close()  # idempotent, and no second on_done
        ends.sandbox.close()
        await asyncio.sleep(0.05)
        assert ends.done == 1
        relays.stop()
        assert fds() == before

    asyncio.run(main())


@pytestmark_native
def test_an_owners_close_ends_both_connections_and_tells_nobody() -> None:
    """The sweep ends a tunnel (idle, revoked, shutdown): both peers see the end, the
    owner's on_done is not called (it closed it), and the descriptors are gone."""
    async def main() -> None:
        before = fds()
        relays = Relays()
        ends = Ends(relays)
        ends.relay.start()
        loop = asyncio.get_running_loop()
        await send(ends.sandbox, b"ping", eof=False)
        assert await asyncio.wait_for(loop.sock_recv(ends.server, 10), 5) == b"ping"
        before_close = ends.relay.last
        ends.relay.close()
        assert await asyncio.wait_for(read_all(ends.sandbox), 5) == b""
        assert await asyncio.wait_for(read_all(ends.server), 5) == b""
        assert ends.relay.bytes_out == 4 and ends.relay.last == before_close
        await asyncio.sleep(0.05)
        assert ends.done == 0 and not relays.live
        ends.close()
        relays.stop()
        assert fds() == before

    asyncio.run(main())


@pytestmark_native
def test_stop_closes_the_tunnels_still_running() -> None:
    async def main() -> None:
        before = fds()
        relays = Relays()
        ends = [Ends(relays) for _ in range(5)]
        for e in ends:
            e.relay.start()
        relays.stop()
        for e in ends:
            assert await asyncio.wait_for(read_all(e.sandbox), 5) == b""
            e.close()
        assert fds() == before

    asyncio.run(main())


@pytestmark_native
def test_small_reads_use_the_buffer_and_a_bulk_transfer_the_pipe() -> None:
    async def main() -> None:
        relays = Relays()
        ends = Ends(relays)
        ends.relay.start()
        loop = asyncio.get_running_loop()

        async def ping_pong(rounds: int) -> None:
            for _ in range(rounds):
                await send(ends.sandbox, b"ping", eof=False)
                assert await asyncio.wait_for(loop.sock_recv(ends.server, 10), 5) == b"ping"
                await send(ends.server, b"pong", eof=False)
                assert await asyncio.wait_for(loop.sock_recv(ends.sandbox, 10), 5) == b"pong"

        await ping_pong(3)
        assert relays.stats()[1:] == (6, 0)
        big = os.urandom(8 * PIPE)
        _, at_sandbox = await asyncio.wait_for(asyncio.gather(
            send(ends.server, big, eof=False), read_n(ends.sandbox, len(big))), 30)
        assert at_sandbox == big
        _, small, spliced = relays.stats()
        assert spliced > 0
        await ping_pong(3)  # the first pong may be spliced, and turns the way back
        _, small_after, spliced_after = relays.stats()
        assert spliced_after - spliced <= 1 and small_after - small >= 5
        assert (ends.relay.bytes_out, ends.relay.bytes_in) == (24, len(big) + 24)
        ends.close()
        relays.stop()

    asyncio.run(main())


@pytestmark_native
def test_a_small_read_the_destination_cannot_take_whole_waits_in_order() -> None:
    async def main() -> None:
        before = fds()
        relays = Relays()
        ends = Ends(relays, mss=1400)  # (a segment the 4 KiB buffer takes: 0.4 s, not 10)
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
        ends.server.shutdown(socket.SHUT_WR)
        await _until(lambda: ends.done)
        ends.close()
        relays.stop()
        assert fds() == before

    asyncio.run(main())


@pytestmark_native
def test_a_stalled_reader_costs_no_cpu() -> None:
    """A destination that reads nothing for a while: the thread stops reading (a full
    pipe, or a pipe with no slot left) and waits, instead of spinning on a source that
    stays readable; then everything arrives."""
    async def main() -> None:
        relays = Relays()
        ends = Ends(relays)
        ends.relay.start()
        loop = asyncio.get_running_loop()
        big = os.urandom(16 * PIPE)
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
        relays.stop()

    asyncio.run(main())


@pytestmark_native
def test_a_relay_dropped_unstarted_or_unclosed_leaves_nothing() -> None:
    """A relay that never started closes the sockets it was given; a Tunnel object
    dropped while running closes its descriptors."""
    async def main() -> None:
        before = fds()
        relays = Relays()
        unstarted = Ends(relays)
        unstarted.relay.close()
        unstarted.close()
        ends = Ends(relays)
        ends.relay.start()
        relays.live.clear()
        ends.relay._tunnel = None  # the last reference to the Tunnel object
        assert await asyncio.wait_for(read_all(ends.sandbox), 5) == b""
        ends.sandbox.close()
        ends.server.close()
        relays.stop()
        assert fds() == before

    asyncio.run(main())
