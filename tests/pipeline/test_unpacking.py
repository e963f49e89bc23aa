"""Each sandbox's unpacking bucket (`pipeline/unpacking.py`): refilled by the clock up to
its size, one per sandbox, bounded in number, never for the time it sat full. (That
the exchange's calls charge it, on each engine: tests/integration/test_unpack_budget.py.)"""

from __future__ import annotations

from gateway.pipeline.unpacking import UnpackBudgets


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


def test_a_bucket_spent_after_it_was_full_is_not_refilled_for_that_time() -> None:
    """A full bucket is returned without reading the clock (most requests); once spent,
    it is refilled from the next request's time, not for the time it sat full."""
    clock = _Clock()
    budgets = UnpackBudgets(1000, 100, clock=clock)
    b = budgets.for_sandbox("b")
    clock.now = 50.0
    assert budgets.for_sandbox("b") is b and b.left == 1000
    b.left -= 1000  # (spent by the request at 50 s)
    clock.now = 51.0
    assert budgets.for_sandbox("b").left == 0  # (not 1000: it was full until 50)
    clock.now = 52.0
    assert budgets.for_sandbox("b").left == 100
