"""`SharedMinter` on its own: what a process does when the mint share cannot answer, when
the mint fails, when the process holding the lease died, and how long it waits. (Two
real stores: tests/services/state/test_state_contract.py; two worker processes:
tests/integration/test_worker_minting.py.)"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gateway.core.secret_value import MintedValue
from gateway.net.resolver import new_event_loop
from gateway.services.minting.base import MintFailed
from gateway.services.minting.shared import SharedMinter
from gateway.services.state.base import MemoryMints, SharedMint, StateUnavailable


def run(scenario: Any) -> None:
    asyncio.run(scenario(), loop_factory=new_event_loop)


class Minter:
    """Counts mints; fails while `failing`."""

    def __init__(self, lifetime: float | None = 3600) -> None:
        self.count = 0
        self.failing = False
        self.lifetime = lifetime

    async def __call__(self) -> MintedValue:
        self.count += 1
        await asyncio.sleep(0.01)
        if self.failing:
            raise MintFailed("the token endpoint answered 500", transient=True)
        return MintedValue(f"tok-{self.count}-abcdefghijkl", lifetime=self.lifetime,
                           parts=(f"tok-{self.count}-abcdefghijkl", "second-part-0123"))


class Down(MemoryMints):
    """A store that cannot answer (the file unwritable, Redis gone)."""

    async def read_mint(self, name: str) -> SharedMint | None:
        raise StateUnavailable("the state file cannot be read (disk I/O error)")


def test_the_store_out_of_reach_means_minting_here() -> None:
    async def scenario() -> None:
        minter = Minter()
        shared = SharedMinter(Down(), lambda lifetime: 3000)
        first = await shared.mint("minted:a:1", minter)
        second = await shared.mint("minted:a:1", minter)
        assert minter.count == 2 and first != second  # (each call mints: no sharing)

    run(scenario)


def test_a_failed_mint_gives_the_lease_back() -> None:
    async def scenario() -> None:
        share, minter = MemoryMints(), Minter()
        one, two = SharedMinter(share, lambda lt: 3000), SharedMinter(share, lambda lt: 3000)
        minter.failing = True
        with pytest.raises(MintFailed):
            await one.mint("minted:a:1", minter)
        minter.failing = False
        started = time.monotonic()
        value = await two.mint("minted:a:1", minter)
        assert time.monotonic() - started < 0.5  # (not waiting out the lease)
        assert value.parts == ("tok-2-abcdefghijkl", "second-part-0123")

    run(scenario)


def test_a_lease_whose_holder_died_lapses() -> None:
    async def scenario() -> None:
        share, minter = MemoryMints(), Minter()
        assert await share.lease_mint("minted:a:1", "dead-process", time.time() + 0.3)
        started = time.monotonic()
        value = await SharedMinter(share, lambda lt: 3000, lease=1.0).mint("minted:a:1", minter)
        waited = time.monotonic() - started
        assert minter.count == 1 and value.reveal() == "tok-1-abcdefghijkl"
        assert 0.25 < waited < 0.8, waited

    run(scenario)


def test_no_wait_is_longer_than_the_lease() -> None:
    """A holder that keeps renewing its lease (a hung mint in another process): the
    waiter gives up after the lease with a transient failure (the cache backs off)."""
    async def scenario() -> None:
        share, minter = MemoryMints(), Minter()
        shared = SharedMinter(share, lambda lt: 3000, lease=0.3)

        async def hog() -> None:
            while True:
                await share.lease_mint("minted:a:1", "hog", time.time() + 0.3)
                await asyncio.sleep(0.05)

        task = asyncio.create_task(hog())
        await asyncio.sleep(0.01)  # (the hog holds it first)
        started = time.monotonic()
        with pytest.raises(MintFailed, match="held the mint"):
            await shared.mint("minted:a:1", minter)
        task.cancel()
        assert minter.count == 0 and time.monotonic() - started < 0.6

    run(scenario)


@pytest.mark.parametrize(("lifetime", "expected"), [(3600.0, 3600.0), (None, None)])
def test_a_shared_value_has_the_lifetime_it_has_left(lifetime: float | None,
                                                     expected: float | None) -> None:
    async def scenario() -> None:
        share, minter = MemoryMints(), Minter(lifetime)
        await SharedMinter(share, lambda lt: 3000).mint("minted:a:1", minter)
        await asyncio.sleep(0.1)
        taken = await SharedMinter(share, lambda lt: 3000).mint("minted:a:1", minter)
        assert minter.count == 1
        if expected is None:
            assert taken.lifetime is None
        else:
            assert taken.lifetime is not None and expected - 1 < taken.lifetime < expected - 0.05

    run(scenario)
