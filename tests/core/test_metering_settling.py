"""Which reservation an ended session response settles: a table, then the invariant that
makes the choice safe, checked over random sessions whose ids the provider scrambled."""

from __future__ import annotations

import random

import pytest

from gateway.core.metering.settling import Bound, Ending, all_unread, ending

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
    ("usage unread: nothing released (it could be any of them)", [BIG, SMALL], None,
     "resp_b", Ending(None)),
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


@pytest.mark.parametrize(("pending", "unread", "expected"), [
    (0, 0, False), (0, 1, False), (2, 1, False), (2, 2, True), (1, 3, True)])
def test_all_unread(pending: int, unread: int, expected: bool) -> None:
    assert all_unread(pending, unread) is expected


@pytest.mark.parametrize("seed", range(300))
def test_a_session_charges_within_what_it_reserved(seed: int) -> None:
    """Responses with random bounds end in a random order, each using at most its bound
    (its usage unread one time in four, or refused before it began); the gateway sees ids
    scrambled. After each end: the reservations left, sorted, are at least the bounds of
    the responses not yet settled (running or ended unread), one for one; what was
    charged plus what is held never passes what was reserved; and at the end what was
    charged is at least what was used."""
    rng = random.Random(seed)
    running = [(rng.choice([64, 100, 4_000, 16_000]) + rng.randrange(50), f"r{i}")
               for i in range(rng.randrange(1, 9))]
    reserved = [Bound(b, 0, rng.choice([None, *(r for _, r in running)]))
                for b, _ in running]
    total = sum(b.tokens for b in reserved)
    charged = used_total = 0
    unread: list[int] = []  # the bounds of responses that ended unread
    while running:
        bound, rid = running.pop(rng.randrange(len(running)))
        if rng.random() < 0.15:  # refused before it began: the smallest is released
            reserved.pop(ending(reserved, (0, 0), None).index or 0)
        else:
            used = rng.randrange(bound + 1)
            read = rng.random() > 0.25
            used_total += used
            chosen = ending(reserved, (used, 0) if read else None, rid)
            if chosen.index is None:
                unread.append(bound)
            else:
                charged += used
                reserved.pop(chosen.index)
        if all_unread(len(reserved), len(unread)):
            charged += sum(b.tokens for b in reserved)
            reserved, unread = [], []
        left = sorted(b.tokens for b in reserved)
        need = sorted([b for b, _ in running] + unread)
        assert len(left) == len(need)
        assert all(r >= n for r, n in zip(left, need, strict=True)), (left, need)
        assert charged + sum(left) <= total, (charged, left, total)
    assert not reserved and charged >= used_total
