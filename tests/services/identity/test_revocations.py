"""Revocations never wait for the state store (`identity/revocations.py`): held in the
process at once, relayed to the other workers, written to the store when it can be
(held and retried), the supervisor told once it is written. The table: what the answer
says (`everywhere`) for each relay outcome and store state."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.services.identity.revocations import Relayed, Revocation, Revocations
from gateway.services.state.base import MemoryState, StateUnavailable

FAR = time.time() + 3600


class Flaky(MemoryState):
    """A store whose writes fail while `down` (a full disk, Redis gone)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.writes = 0

    async def revoke(self, jti: str, expires_at: float) -> None:
        self.writes += 1
        if self.down:
            raise StateUnavailable("the state file cannot be written (disk full)")
        await super().revoke(jti, expires_at)


class FakeRelay:
    """The supervisor's answer, fixed; what the worker told it."""

    def __init__(self, answer: Relayed) -> None:
        self.answer = answer
        self.sent: list[str] = []
        self.stored_ids: list[str] = []

    async def broadcast(self, jti: str, expires_at: float) -> Relayed:
        self.sent.append(jti)
        return self.answer

    def stored(self, jti: str) -> None:
        self.stored_ids.append(jti)


@pytest.mark.parametrize(("answer", "down", "everywhere"), [
    (None, True, True),  # one process: it holds it, whatever the store
    (None, False, True),
    (Relayed(held=(0, 1)), True, True),  # every worker confirmed: the store can wait
    (Relayed(held=(0,), missing=(1,)), False, True),  # one did not, but the store has it
    (Relayed(held=(0,), missing=(1,)), True, False),  # neither: not known everywhere
    (Relayed(reached=False), True, False),
    (Relayed(reached=False), False, True),
])
def test_a_revocation_says_where_it_holds(answer: Relayed | None, down: bool,
                                          everywhere: bool) -> None:
    state = Flaky()
    state.down = down
    revocations = Revocations(state)
    relay = FakeRelay(answer) if answer is not None else None
    revocations.relay = relay
    done = asyncio.run(revocations.revoke("j1", FAR))
    assert done.everywhere is everywhere
    assert done.stored is not down and (done.pending is None) is not down
    assert revocations.is_revoked("j1")  # here at once, whatever happened elsewhere
    assert state.is_revoked("j1") is not down
    if relay is not None:
        assert relay.sent == ["j1"] and relay.stored_ids == ([] if down else ["j1"])


def test_a_revocation_made_while_the_store_is_away_is_written_when_it_is_back() -> None:
    state = Flaky()
    relay = FakeRelay(Relayed(held=(0, 1)))
    revocations = Revocations(state)
    revocations.relay = relay

    async def scenario() -> None:
        state.down = True
        done = await revocations.revoke("j1", FAR)
        assert done == Revocation("j1", 2, (), False, done.pending)
        assert done.pending is not None and "disk full" in done.pending
        assert await revocations.write_pending() == 1  # (still away)
        state.down = False
        assert await revocations.write_pending() == 0
        assert state.is_revoked("j1") and relay.stored_ids == ["j1"]
        writes = state.writes
        assert await revocations.write_pending() == 0 and state.writes == writes

    asyncio.run(scenario())


def test_relayed_revocations_hold_here_and_are_written_by_the_worker_that_took_them() -> None:
    state = Flaky()
    revocations = Revocations(state)
    revocations.learn("other", FAR)  # (another worker took it: it writes it)
    assert revocations.is_revoked("other") and not state.is_revoked("other")
    assert revocations.pending == 0
    assert not revocations.is_revoked("never")


def test_a_started_worker_takes_over_what_the_store_does_not_have() -> None:
    """The supervisor's snapshot: revocations whose worker exited before writing them.
    The new worker holds them at once and writes them; an expired one is dropped."""
    state = Flaky()
    state.down = True
    revocations = Revocations(state)
    revocations.relay = relay = FakeRelay(Relayed())
    revocations.adopt([("j1", FAR), ("old", time.time() - 1)])
    assert revocations.is_revoked("j1") and revocations.pending == 2
    state.down = False
    assert asyncio.run(revocations.write_pending()) == 0
    assert state.is_revoked("j1") and not state.is_revoked("old")
    assert relay.stored_ids == ["j1"]


def test_the_writer_retries_every_second_until_stopped() -> None:
    state = Flaky()
    revocations = Revocations(state)

    async def scenario() -> None:
        state.down = True
        await revocations.revoke("j1", FAR)
        revocations.start()
        try:
            await asyncio.sleep(0.2)
            state.down = False
            deadline = time.monotonic() + 3
            while revocations.pending and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert revocations.pending == 0 and state.is_revoked("j1")
        finally:
            await revocations.stop()

    asyncio.run(scenario())


def test_stopping_with_revocations_the_store_never_got_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    state = Flaky()
    state.down = True
    revocations = Revocations(state)

    async def scenario() -> None:
        await revocations.revoke("j-lost", FAR)
        await revocations.stop()

    asyncio.run(scenario())
    assert "were never written to the state store" in caplog.text and "j-lost" in caplog.text
