"""The state file's health and held changes (gateway/services/state/sqlite_file.py), on a
real 2 MiB tmpfs filled up: a process keeps enforcing from its view, holds what it could
not write and writes it once it can; every process notices the outage and its end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.clock import run
from helpers.disk import fill as fill_up
from helpers.disk import tiny_tmpfs
from helpers.sqlite_states import leased_states

from gateway.observability import metrics
from gateway.services.state.base import StateUnavailable
from gateway.services.state.counters import Admission, Limit, StoreAway
from gateway.services.state.sqlite import SqliteState

FAR = time.time() + 3600


def started(path: Path) -> SqliteState:
    state = SqliteState(path)
    run(state.start())
    return state


def up() -> float:
    return metrics.STATE_STORE_UP.labels(store="sqlite")._value.get()  # type: ignore[attr-defined, no-any-return]


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    yield from tiny_tmpfs(tmp_path / "disk", "2m")


def test_a_full_disk_keeps_enforcing_and_writes_what_it_held_later(tiny_disk: Path) -> None:
    path = tiny_disk / "state" / "gateway.db"

    async def scenario() -> None:
        state = SqliteState(path)
        await state.start()
        await state.take_lease("slot", beat=3600)
        limit = Admission((Limit((("b", "r"),), 4, 1),), (("b", "r", 1, FAR),))
        try:
            state.count([("usage", "sb", 5, FAR)])
            state.flush()
            assert [state.admit(limit) for _ in range(2)] == [None, None]  # (its share)
            filler = fill_up(tiny_disk)
            # A revocation: holds here at once, the caller is told it is not shared yet.
            with pytest.raises(StateUnavailable, match="is held in this process"):
                await state.revoke("j-full", FAR)
            assert state.is_revoked("j-full")
            # Counting goes on locally (many rows: more than the WAL's free pages).
            state.count([("usage", f"f{i}", 1, FAR) for i in range(4000)])
            state.count([("usage", "sb", 7, FAR)])
            state.flush()
            assert state.problem is not None and "full" in state.problem
            assert state.counters_degraded and up() == 0
            assert state.counter("usage", "sb") == 12
            # Admission decides on this process's share meanwhile (the one process: the
            # room left, at most what it admitted lately, 2).
            assert [state.admit(limit) for _ in range(3)] == [None, None, 0]
            # Space returns: the retry (every second) writes everything that was held.
            filler.unlink()
            deadline = time.monotonic() + 5
            while state.problem is not None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert state.problem is None and up() == 1
            other = SqliteState(path)  # another process's view of the file
            await other.start()
            try:
                assert other.is_revoked("j-full")
                assert other.counter("usage", "sb") == 12
                assert other.counter("usage", "f3999") == 1
                assert other.counter("b", "r") == 4
            finally:
                await other.close()
        finally:
            await state.close()

    run(scenario())


def test_every_process_notices_a_full_disk_and_its_end(tiny_disk: Path) -> None:
    """Not only the process whose write failed: one that writes nothing probes the file
    (`problem`, `/readyz`), and sees the disk come back within seconds."""
    path = tiny_disk / "state" / "gateway.db"

    async def scenario() -> None:
        writer, idle = SqliteState(path), SqliteState(path)
        await writer.start()
        await idle.start()
        try:
            filler = fill_up(tiny_disk)
            # Revoked twice while full: one change held, written once.
            for _ in range(2):
                with pytest.raises(StateUnavailable, match="is held in this process"):
                    await writer.revoke("j-full", FAR)
            assert len(writer._held) == 1
            deadline = time.monotonic() + 6
            while idle.problem is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert idle.problem is not None and "full" in idle.problem
            filler.unlink()
            deadline = time.monotonic() + 4
            while (idle.problem or writer.problem) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert idle.problem is None and writer.problem is None
            assert idle.is_revoked("j-full")
        finally:
            await writer.close()
            await idle.close()

    run(scenario())


def test_processes_on_a_full_disk_stay_within_a_budget_together(tiny_disk: Path) -> None:
    """Two processes on one state file admit on a full disk (the admission's transaction
    fails): each may add only its share of the room the file shows (4 of 10 used: 3
    each), at most what it admitted lately (2 each), so once space returns the file
    holds 8, not 16. (Measured before: each admitted on its own reading, 6 each.)"""
    path = tiny_disk / "state" / "gateway.db"

    async def scenario() -> None:
        async with leased_states(path) as states:
            limit = Admission((Limit((("b", "r"),), 10, 1),), (("b", "r", 1, FAR),))
            assert [states[i].admit(limit) for i in (0, 1, 0, 1)] == [None] * 4
            filler = fill_up(tiny_disk)
            admitted = [sum(s.admit(limit) is None for _ in range(8)) for s in states]
            assert all(s.counters_degraded for s in states)
            assert admitted == [2, 2]
            filler.unlink()
            deadline = time.monotonic() + 5
            while any(s.counters_degraded for s in states):
                assert time.monotonic() < deadline
                for s in states:
                    s.flush()
                await asyncio.sleep(0.1)
            assert states[0].counter("b", "r") == 8

    run(scenario())


def test_under_refuse_a_full_disk_admits_nothing_and_counts_nothing(tiny_disk: Path) -> None:
    """`state.unavailable: refuse` (``share=False``): an admission whose transaction fails
    raises StoreAway and counts nothing here, so the file holds what was admitted before
    once space returns."""
    path = tiny_disk / "state" / "gateway.db"

    async def scenario() -> None:
        state = SqliteState(path)
        await state.start()
        try:
            limit = Admission((Limit((("b", "r"),), 10, 1),), (("b", "r", 1, FAR),))
            assert [state.admit(limit, share=False) for _ in range(4)] == [None] * 4
            filler = fill_up(tiny_disk)
            for _ in range(3):
                with pytest.raises(StoreAway, match="the state file cannot be used"):
                    state.admit(limit, share=False)
            assert state.counters_degraded
            assert state.counter("b", "r") == 4
            filler.unlink()
            deadline = time.monotonic() + 5
            while state.counters_degraded:
                assert time.monotonic() < deadline
                state.flush()
                await asyncio.sleep(0.1)
            assert state.admit(limit, share=False) is None
            assert state.counter("b", "r") == 5
        finally:
            await state.close()

    run(scenario())
