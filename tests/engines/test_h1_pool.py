"""The upstream pool's bookkeeping (gateway/engines/h1/pool.py): keys, bounds, expiry.

The connections are stand-ins with the two things the pool reads (`key`, `reusable()`)
and `close()`; tests/integration/test_upstream_pool.py runs the real thing.
"""

from __future__ import annotations

from typing import Any

from gateway.engines.h1 import pool
from gateway.engines.h1.pool import UpstreamPool


class Conn:
    def __init__(self, key: tuple[object, ...], live: bool = True) -> None:
        self.key = key
        self.live = live
        self.closed = False
        self.partner: Any = object()
        self.parked_at = 0.0

    def reusable(self) -> bool:
        return self.live and not self.closed

    def close(self) -> None:
        self.closed = True


A = ("sandbox-1", ("127.0.0.1", 443), "a.test", True)
B = ("sandbox-2", ("127.0.0.1", 443), "a.test", True)


def test_a_parked_connection_serves_only_its_own_key() -> None:
    p = UpstreamPool(30)
    conn = Conn(A)
    p.park(conn, 0.0)  # type: ignore[arg-type]
    assert conn.partner is None and len(p) == 1
    assert p.take(B) is None
    assert p.take(A) is conn and len(p) == 0
    assert p.take(A) is None


def test_dead_or_unclean_connections_are_closed_not_kept() -> None:
    p = UpstreamPool(30)
    dead = Conn(A, live=False)
    p.park(dead, 0.0)  # type: ignore[arg-type]
    assert dead.closed and len(p) == 0
    later = Conn(A)
    p.park(later, 0.0)  # type: ignore[arg-type]
    later.live = False  # the upstream closed it while parked
    assert p.take(A) is None and later.closed and len(p) == 0


def test_bounds_per_key_and_in_all() -> None:
    p = UpstreamPool(30, limit=5)
    conns = [Conn(A) for _ in range(pool.PER_KEY + 2)]
    for c in conns:
        p.park(c, 0.0)  # type: ignore[arg-type]
    assert len(p) == 5 and all(c.closed for c in conns[5:])
    q = UpstreamPool(30)
    more = [Conn(A) for _ in range(pool.PER_KEY + 2)] + [Conn(B)]
    for c in more:
        q.park(c, 0.0)  # type: ignore[arg-type]
    assert len(q) == pool.PER_KEY + 1 and [c.closed for c in more].count(True) == 2


def test_expiry_and_close_all() -> None:
    p = UpstreamPool(10)
    old, new = Conn(A), Conn(B)
    p.park(old, 0.0)  # type: ignore[arg-type]
    p.park(new, 8.0)  # type: ignore[arg-type]
    p.expire(12.0)
    assert old.closed and not new.closed and len(p) == 1
    p.close_all()
    assert new.closed and len(p) == 0
    late = Conn(A)
    p.park(late, 13.0)  # type: ignore[arg-type]
    assert late.closed  # (shut down: nothing parked any more)


def test_no_idle_timeout_keeps_nothing() -> None:
    p = UpstreamPool(0)
    conn = Conn(A)
    p.park(conn, 0.0)  # type: ignore[arg-type]
    assert conn.closed and len(p) == 0


def test_one_sandbox_cannot_take_the_whole_pool() -> None:
    p = UpstreamPool(30)
    mine = [Conn(("sandbox-1", ("127.0.0.1", 443), f"h{i}.test", True))
            for i in range(pool.PER_SANDBOX + 3)]
    for c in mine:
        p.park(c, 0.0)  # type: ignore[arg-type]
    assert len(p) == pool.PER_SANDBOX and sum(c.closed for c in mine) == 3
    other = Conn(B)
    p.park(other, 0.0)  # type: ignore[arg-type]
    assert not other.closed and len(p) == pool.PER_SANDBOX + 1
    assert p.take(mine[0].key) is mine[0]  # (freed: sandbox-1 may park one again)
    again = Conn(A)
    p.park(again, 0.0)  # type: ignore[arg-type]
    assert not again.closed
