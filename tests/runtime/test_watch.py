"""The supervisor's restart backoff (gateway/runtime/watch.py); the supervisor itself runs
as real processes in tests/integration/test_worker_processes.py (a killed worker, a
killed supervisor, only the standard library loaded)."""

from __future__ import annotations

import pytest

from gateway.runtime.watch import STABLE, next_restart


@pytest.mark.parametrize(
    ("previous", "ran_for", "count", "wait"),
    [
        (0, 0.5, 1, 1.0),             # the first death: 1 s
        (1, 2.0, 2, 2.0),             # dying again soon after it started: doubling
        (2, 2.0, 3, 4.0),
        (4, 2.0, 5, 16.0),
        (5, 2.0, 6, 30.0),            # at most 30 s
        (40, 2.0, 41, 30.0),
        (5, STABLE, 1, 1.0),          # it had run long enough: from 1 s again
        (40, STABLE * 100, 1, 1.0),
        (3, STABLE - 0.1, 4, 8.0),
    ],
)
def test_a_worker_that_keeps_dying_waits_longer_one_that_ran_starts_over(
        previous: int, ran_for: float, count: int, wait: float) -> None:
    assert next_restart(previous, ran_for) == (count, wait)
