"""The supervisor's revocation relay (`runtime/relay.py`) and a worker's end of it
(`runtime/relay_link.py`), over real socketpairs: the supervisor's side pumped in a
thread, as the lean supervisor pumps it between its other work, the workers' ends on an
event loop, as in a gateway worker."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gateway.runtime.relay import Lines, Relay, encode
from gateway.runtime.relay_link import RelayLink

FAR = time.time() + 3600


# The supervisor is one thread: its pump and its `attach` never overlap. Here the pump
# runs in a thread of its own, so the two take turns under this lock.
SUPERVISOR = threading.Lock()


@contextmanager
def pumping(relay: Relay) -> Iterator[None]:
    """The supervisor's side served in a thread until the block ends."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            with SUPERVISOR:
                relay.pump(0.0)
            stop.wait(0.002)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


class Worker:
    """A worker's end: what it was relayed (the snapshot and the early ones first)."""

    def __init__(self, link: RelayLink) -> None:
        self.link = link
        self.snapshot = link.snapshot
        self.held: dict[str, float] = dict(link.early)

    def start(self) -> Worker:
        self.link.start(self.held.__setitem__)
        return self


def link(relay: Relay, index: int) -> int:
    """A new link for worker `index`, made between two pumps (the worker's end's fd)."""
    with SUPERVISOR:
        return relay.attach(index).detach()


async def attach(relay: Relay, index: int) -> Worker:
    return Worker(await RelayLink.open(link(relay, index)))


def test_a_revocation_reaches_every_worker_before_it_is_answered() -> None:
    relay = Relay()

    async def scenario() -> None:
        workers = [(await attach(relay, i)).start() for i in range(3)]
        try:
            assert [w.snapshot for w in workers] == [[], [], []]
            done = await workers[0].link.broadcast("j1", FAR)
            assert (done.held, done.missing, done.reached) == ((0, 1, 2), (), True)
            assert [w.held for w in workers] == [{}, {"j1": FAR}, {"j1": FAR}]
        finally:
            for w in workers:
                await w.link.close()

    with pumping(relay):
        asyncio.run(scenario())
    relay.close()


def test_a_worker_that_does_not_acknowledge_in_time_is_named() -> None:
    relay = Relay(timeout=0.3)

    async def scenario() -> None:
        awake = (await attach(relay, 0)).start()
        stuck = await attach(relay, 1)  # (never reads: a worker whose loop is stuck)
        try:
            started = time.monotonic()
            done = await awake.link.broadcast("j1", FAR)
            assert (done.held, done.missing) == ((0,), (1,))
            assert 0.25 < time.monotonic() - started < 2.0
        finally:
            await awake.link.close()
            await stuck.link.close()

    with pumping(relay):
        asyncio.run(scenario())
    relay.close()


def test_a_worker_still_starting_is_not_waited_for_and_learns_it_before_it_serves() -> None:
    """A worker being started (seconds of imports) holds no connection: the answer does
    not wait for it, and it reads what was relayed meanwhile before its `welcome`."""
    relay = Relay(timeout=5.0)

    async def scenario() -> None:
        first = (await attach(relay, 0)).start()
        starting = link(relay, 1)  # (its process has not opened the link yet)
        try:
            began = time.monotonic()
            done = await first.link.broadcast("j1", FAR)
            assert (done.held, done.missing) == ((0,), ())
            assert time.monotonic() - began < 2.0
            late = Worker(await RelayLink.open(starting))
            assert (late.snapshot, late.held) == ([], {"j1": FAR})  # (relayed early)
            late.start()
            done = await first.link.broadcast("j2", FAR)  # (now it serves: waited for)
            assert (done.held, done.missing) == ((0, 1), ())
            assert late.held == {"j1": FAR, "j2": FAR}
            await late.link.close()
        finally:
            await first.link.close()

    with pumping(relay):
        asyncio.run(scenario())
    relay.close()


def test_a_worker_that_exits_is_not_waited_for() -> None:
    relay = Relay(timeout=5.0)

    async def scenario() -> None:
        first = (await attach(relay, 0)).start()
        gone = await attach(relay, 1)
        await gone.link.close()  # (it exited: its end is closed)
        try:
            started = time.monotonic()
            done = await first.link.broadcast("j1", FAR)
            assert (done.held, done.missing) == ((0,), ())
            assert time.monotonic() - started < 2.0
        finally:
            await first.link.close()

    with pumping(relay):
        asyncio.run(scenario())
    relay.close()


def test_a_restarted_worker_learns_what_the_store_does_not_have() -> None:
    """The supervisor keeps each revocation until a worker says it is stored; a worker
    started later gets those in its snapshot (an expired one is dropped)."""
    relay = Relay()

    async def revoke() -> None:
        worker = (await attach(relay, 0)).start()
        try:
            await worker.link.broadcast("kept", FAR)
            await worker.link.broadcast("written", FAR)
            await worker.link.broadcast("expired", time.time() + 0.2)
            worker.link.stored("written")
            await asyncio.sleep(0.3)
        finally:
            await worker.link.close()

    async def restart() -> list[tuple[str, float]]:
        worker = await attach(relay, 0)
        await worker.link.close()
        return worker.snapshot

    with pumping(relay):
        asyncio.run(revoke())
        assert asyncio.run(restart()) == [("kept", FAR)]
    relay.close()


def test_a_link_that_sends_garbage_is_dropped_the_others_go_on() -> None:
    relay = Relay()

    async def scenario() -> None:
        good = (await attach(relay, 0)).start()
        bad = (await attach(relay, 1)).start()
        try:
            bad.link.writer.write(b"[1, 2]\n")  # (not an object: the link is dropped)
            await asyncio.sleep(0.2)
            assert sorted(relay.peers) == [0]
            done = await good.link.broadcast("j1", FAR)
            assert (done.held, done.missing) == ((0,), ())
            # The dropped worker's broadcast is not answered: it says so, and does not hang.
            lost = await bad.link.broadcast("j2", FAR)
            assert not lost.reached
        finally:
            await good.link.close()
            await bad.link.close()

    with pumping(relay):
        asyncio.run(scenario())
    relay.close()


def test_lines_split_messages_across_reads_and_refuse_what_is_not_an_object() -> None:
    lines = Lines()
    data = encode({"op": "ack", "id": 1}) + encode({"op": "stored", "jti": "j"})
    assert lines.feed(data[:5]) == []
    assert lines.feed(data[5:]) == [{"op": "ack", "id": 1}, {"op": "stored", "jti": "j"}]
    with pytest.raises(ValueError):
        Lines().feed(b'"text"\n')
    with pytest.raises(ValueError):
        Lines().feed(b"{not json\n")
