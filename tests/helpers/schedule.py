"""The order the suite runs in: the slowest tests first (`tests/conftest.py` applies it).

`make test` spreads the tests over the cores with pytest-xdist, `--dist worksteal`
(pyproject.toml): each worker takes half of the collection in order, and one that runs
out takes the second half of the longest queue left. A test cannot be split, so a long
test that starts late makes the run's tail as long as itself (the soak's 80 s, the
benchmark's 56 s); started first, the short tests fill in around them and the workers
end together.

`SECONDS` holds what the slowest tests took, one row of a parametrized test (measured
one directory at a time with `-n 0` on a loaded 2-core machine: weights for the order,
not promises). A test marked `slow` that is not listed weighs `SLOW`, so a new slow test
runs early before anyone measures it. Nothing else moves: the rest keeps pytest's order
(module by module, where module fixtures are shared).
"""

from __future__ import annotations

from pathlib import Path

import pytest

SLOW = 10.0  # seconds: a test marked `slow` that `SECONDS` does not list

SECONDS: dict[str, float] = {
    "tests/reliability/test_soak.py::test_soak_mixed_load_leaves_no_sockets_and_flat_memory": 82,
    "tests/test_bench_smoke.py::test_quick_benchmark_produces_every_row_and_workload": 56,
}


def weight(item: pytest.Item) -> float:
    """Seconds `item` is expected to take, for the order (0: a short test)."""
    listed = SECONDS.get(item.nodeid.split("[", 1)[0])
    if listed is not None:
        return listed
    return SLOW if item.get_closest_marker("slow") is not None else 0.0


def slowest_first(items: list[pytest.Item]) -> None:
    """Reorder `items` in place: the heaviest first, the others as collected (a stable
    sort: equal weights keep their order)."""
    items.sort(key=weight, reverse=True)


def stale(root: Path) -> list[str]:
    """`SECONDS` entries whose file or test function no longer exists."""
    gone = []
    for test in SECONDS:
        path, _, name = test.partition("::")
        source = root / path
        if not source.is_file() or f"def {name}(" not in source.read_text():
            gone.append(test)
    return gone
