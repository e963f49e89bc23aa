"""Reservations under a holder: nothing a gateway process admitted is lost when it dies.

A call admitted under a tokens or cost budget reserves its worst case (``rt:``/``rc:``
fields of the budget window's table) in the store before it is forwarded. The
reservation is also recorded under its **holder**: this process's lease, an id with an
expiry the process renews every ``BEAT`` seconds (``LEASE_TTL``). The record is a
counter of the ``ORPHANS`` table whose field names the holder, the budget table and
the reserved field (``held_field``). When the call ends its settlement (what it used,
the reservation released, the record taken back) is written in one transaction, and
only while the holder's lease stands (``Counters.settle``).

A holder whose lease is gone - it expired (the process died, or stalled longer than
``LEASE_TTL``), or a process started in the same **slot** (host, proxy address, worker
index: the one that restarted after a crash) - is dead: whichever live process notices
first (at its start and every ``BEAT``) charges each of its records in full as used
(``rt:`` -> ``t:``, ``rc:`` -> ``c:``) and deletes the records and the lease, in one
transaction (SQLite) or one script (Redis): exactly once. A settlement of a dead
holder is dropped (its reservation was charged), so a call is charged its use or its
reservation, never both, and never nothing. A reservation is an upper bound of what a
call may use, so a dead process's calls are never charged less than they used.

This module is the store-independent, pure part: the names, the records and the
charge; ``lease_keeper.Lease`` is the process's lease and heartbeat over a store's three
primitives (``LeaseStore``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["BEAT", "LEASE_TTL", "ORPHANS", "Charged", "LeaseStore", "charge_of",
           "held_field", "parse_held"]

ORPHANS = "o"  # the counter table of running calls' reservations, by holder
LEASE_TTL = 30.0  # seconds a lease lasts without renewal
BEAT = 5.0  # seconds between renewals (and looks for dead holders)
_SEP = "\x1f"  # between a record's holder, budget table and field (none of them has it)
_CHARGED = {"rt:": "t:", "rc:": "c:"}


def held_field(holder: str, table: str, field: str) -> str:
    """The ``ORPHANS`` field recording what ``holder`` reserved in ``table[field]``."""
    return f"{holder}{_SEP}{table}{_SEP}{field}"


def parse_held(name: str) -> tuple[str, str, str] | None:
    """(holder, table, field) of an ``ORPHANS`` field, or None if it is not one."""
    parts = name.split(_SEP, 2)
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else None


def charge_of(field: str) -> str | None:
    """The settled field a reservation field is charged to (``rt:x`` -> ``t:x``)."""
    target = _CHARGED.get(field[:3])
    return None if target is None else target + field[3:]


@dataclass(frozen=True, slots=True)
class Charged:
    """A dead holder's reservation, charged as used: ``amount`` moved from
    ``table[field]`` (reserved) to its settled field."""

    holder: str
    table: str
    field: str
    amount: int


class LeaseStore(Protocol):
    """What a store does for leases (each answers None/False when it cannot reach its
    store: the outage is the store's to report)."""

    async def lease_claim(self, holder: str, slot: str, ttl: float, takeover: bool) -> bool:
        """Write ``holder``'s lease (``ttl`` seconds); ``takeover``: other leases of
        ``slot`` are dead from now on. False if it could not be written."""

    async def lease_renew(self, holder: str, ttl: float) -> bool | None:
        """Extend ``holder``'s lease; False if it is gone (it was found dead), None if
        the store could not be reached."""

    async def lease_reap(self, release: str | None) -> list[Charged] | None:
        """Charge the records of every dead holder and delete them and their leases,
        in one step (``release``: this holder ends now, its lease given back and its
        records charged too); what was charged (None: the store could not be reached)."""
