"""The supervisor's restart backoff (gateway/runtime/watch.py); the supervisor itself runs
as real processes in tests/integration/test_worker_processes.py (a killed worker, a
killed supervisor, only the standard library loaded)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


# What the supervisor's interpreter would hold for the gateway's life and does not need
# (issue 41: 17.6 -> 13.8 MiB with the allocator; `typing` 0.5, `dataclasses` with
# `inspect` and `ast` 1.3, `shutil` with bz2 and lzma 0.7, imported at the stop).
NOT_IN_THE_SUPERVISOR = ("typing", "dataclasses", "inspect", "shutil", "bz2", "lzma")


def test_the_supervisor_imports_nothing_it_does_not_use() -> None:
    code = ("import sys, gateway.runtime.watch; "
            f"print(sorted(set({NOT_IN_THE_SUPERVISOR!r}) & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
