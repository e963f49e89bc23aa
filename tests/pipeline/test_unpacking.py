"""Each sandbox's unpacking bucket (`pipeline/unpacking.py`): refilled by the clock up to
its size, one per sandbox, bounded in number; an exchange's methods run with its
sandbox's bucket set for the core, and reset after."""

from __future__ import annotations

import asyncio

from gateway.core.unpack_bounds import EXCESS, Excess
from gateway.pipeline.unpacking import UnpackBudgets, charged, charged_async


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_refills_with_time_up_to_its_size() -> None:
    clock = _Clock()
    budgets = UnpackBudgets(1000, 100, clock=clock)
    a = budgets.for_sandbox("a")
    a.left -= 900
    clock.now = 2.0
    assert budgets.for_sandbox("a") is a and a.left == 300
    clock.now = 100.0
    assert budgets.for_sandbox("a").left == 1000
    assert budgets.for_sandbox("b") is not a and budgets.for_sandbox("b").left == 1000


def test_buckets_are_bounded_in_number() -> None:
    clock = _Clock()
    budgets = UnpackBudgets(1000, 1, clock=clock, max_keys=4)
    for i in range(4):
        budgets.for_sandbox(f"s{i}").left = 0  # (all spent: none is dropped as full)
    clock.now = 1.0
    budgets.for_sandbox("new")
    assert len(budgets._buckets) <= 4
    spent = budgets.for_sandbox("s3")
    assert spent.left < 1000  # (the newest spent one kept: not refilled whole)


class _Exchange:
    def __init__(self, excess: Excess | None) -> None:
        self.excess = excess

    @charged
    def read(self) -> Excess | None:
        return EXCESS.get()

    @charged_async
    async def decide(self) -> Excess | None:
        await asyncio.sleep(0)
        return EXCESS.get()


def test_an_exchanges_methods_run_with_its_sandboxs_bucket() -> None:
    excess = Excess(10, 1)
    exchange = _Exchange(excess)
    assert EXCESS.get() is None
    assert exchange.read() is excess and EXCESS.get() is None
    assert asyncio.run(exchange.decide()) is excess and EXCESS.get() is None
    assert _Exchange(None).read() is None
