"""Which reservation an ended session response settles: a table, then the invariant that
makes the choice safe, checked over random sessions whose ids the provider scrambled."""

from __future__ import annotations

import random

import pytest

from gateway.core.metering.settling import Bound, Ending, ending

BIG, SMALL = Bound(16_100, 0, "resp_a"), Bound(100, 0, "resp_b")

CASES = [
    # (what, pending, used, id, expected)
    ("one pending: it", [BIG], (50, 0), "resp_a", Ending(0)),
    ("a short response named by the long one's id releases the short bound",
     [BIG, SMALL], (64, 0), "resp_a", Ending(1)),
    ("a long response releases the long bound whatever id it names",
     [SMALL, BIG], (16_000, 0), "resp_b", Ending(1)),
    ("equal bounds: the id breaks the tie", [Bound(10, 0, "x"), Bound(10, 0, "y")],
     (5, 0), "y", Ending(1)),
    ("equal bounds, no id: the first", [Bound(10, 0), Bound(10, 0)], (5, 0), None,
     Ending(0)),
    ("usage unread: the smallest released, the largest charged", [BIG, SMALL], None,
     "resp_b", Ending(1, 16_100, 0)),
    ("a usage over every bound releases the largest", [SMALL, BIG], (20_000, 0), None,
     Ending(1)),
    ("cost counts too: the bound must cover both", [Bound(500, 10), Bound(1_000, 900)],
     (400, 50), None, Ending(1)),
    ("a refused create (nothing used) releases the smallest", [BIG, SMALL], (0, 0), None,
     Ending(1)),
]


@pytest.mark.parametrize(("pending", "used", "response_id", "expected"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_ending(pending: list[Bound], used: tuple[int, int] | None,
                response_id: str | None, expected: Ending) -> None:
    assert ending(pending, used, response_id) == expected


def test_no_pending_is_an_error() -> None:
    with pytest.raises(ValueError):
        ending([], (1, 0), None)


@pytest.mark.parametrize("seed", range(200))
def test_what_stays_reserved_always_covers_what_still_runs(seed: int) -> None:
    """Responses with random bounds end in a random order, each using at most its bound
    (or its usage unread); the gateway sees ids scrambled. After each end, the
    reservations left, sorted, are at least the bounds of the responses still running,
    one for one, and what was charged is at least what was used."""
    rng = random.Random(seed)
    running = [(rng.choice([64, 100, 4_000, 16_000]) + rng.randrange(50), f"r{i}")
               for i in range(rng.randrange(1, 9))]
    reserved = [Bound(b, 0, rng.choice([None, *(r for _, r in running)]))
                for b, _ in running]
    charged = used_total = 0
    while running:
        bound, rid = running.pop(rng.randrange(len(running)))
        used = rng.randrange(bound + 1)
        read = rng.random() > 0.2
        chosen = ending(reserved, (used, 0) if read else None, rid)
        charged += used if chosen.tokens is None else chosen.tokens
        used_total += used
        reserved.pop(chosen.index)
        left = sorted(b.tokens for b in reserved)
        need = sorted(b for b, _ in running)
        assert all(r >= n for r, n in zip(left, need, strict=True)), (left, need)
        assert charged >= used_total
