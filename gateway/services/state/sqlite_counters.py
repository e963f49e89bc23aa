"""The SQLite store's counters (usage ledger, budgets and their reservations, deferred
jobs) and the leases reservations are recorded under: `SqliteState`'s part for the
`Counters` port and `leases.LeaseStore`.

Counters are added to a pending batch and written within `FLUSH_DELAY` (0.25 s) in one
transaction (`INSERT … ON CONFLICT DO UPDATE value = value + …`): on a busy worker a
transaction costs ~130 µs of CPU (3 statements of ~30 µs with cold caches), and one per
call made a metered call 5-6% dearer (`make bench`). `counter` reads the file (a point
lookup) plus what is pending here; `counter_tables` (`GET /v1/usage`) waits out
`FLUSH_DELAY` first, so it includes every call that ended, on any worker. A settlement
still pending on another worker leaves the call's reservation counted meanwhile.
`admit` (budget admission) is one `BEGIN IMMEDIATE` transaction: the limits are checked
against the committed values and the increments written before any other process can
admit, so workers never overshoot together. It also counts the other processes' shares
(`alone_records`, table `shares`) as used and writes this process's: one whose
transaction fails (a lock held past `busy_timeout`) decides alone on its share.

Reservations outlive their process (`gateway.services.state.leases`): admission commits
a call's reservation and its record under this process's lease (table `leases`: holder,
slot, expiry; renewed every `leases.BEAT`); a settlement waits in the batch with the
rest and is written only if the lease still stands, in the flush's one transaction (the
usage, the release and the record's removal: all or nothing). A process killed before
its batch was written leaves its reservations committed: the next process to start in
its slot, or any live one once the lease expires, charges them as used (`lease_reap`,
one transaction: exactly once).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from gateway.services.state.alone_records import Records, decide_alone, held_for_others, key_of
from gateway.services.state.counters import (
    Admission,
    CounterView,
    Increment,
    Limit,
    StoreAway,
    Table,
    first_refused,
)
from gateway.services.state.lease_keeper import LeaseHolding
from gateway.services.state.leases import ORPHANS, Charged, charge_of, parse_held
from gateway.services.state.sqlite_connect import transaction
from gateway.services.state.sqlite_file import SqliteFile

__all__ = ["FLUSH_DELAY", "SqliteCounters"]

# Add to a counter (its window's expiry kept the latest).
_ADD = ("INSERT INTO counters (tbl, field, value, expires_at) VALUES (?, ?, ?, ?) "
        "ON CONFLICT(tbl, field) DO UPDATE SET value = value + excluded.value, "
        "expires_at = max(expires_at, excluded.expires_at)")
FLUSH_DELAY = 0.25  # seconds a counted increment waits to be written with the next ones
# This process's record of a limit (`tbl`: its key; kept over a lower serial only).
_SHARE = ("INSERT INTO shares (tbl, holder, slot, serial, record, expires_at) VALUES "
          "(?, ?, ?, ?, ?, ?) ON CONFLICT(tbl, holder) DO UPDATE SET serial = "
          "excluded.serial, record = excluded.record, expires_at = max(expires_at, "
          "excluded.expires_at) WHERE excluded.serial > serial")
_REFRESH = 0.005  # seconds after a change of the file this process's records are refreshed
_REFRESH_EVERY = 0.01  # seconds: at most one refresh in this time (a busy file)


class SqliteCounters(SqliteFile, LeaseHolding):
    """The counters and leases of `SqliteState` (see the module docstring)."""

    view: CounterView  # the pending counter batch (the file has the rest)
    _flush_scheduled: bool
    records: Records  # this process's shares (`alone_records`)
    _serial: int  # of its admissions: a record written later wins
    _closing: bool  # it decides nothing alone and its shares go
    _refresh_scheduled: bool  # a refresh of its records is due (the file changed)
    _processes_read: float  # when the live leases were last counted (`processes`)
    _refreshed_at: float  # (monotonic) when its records were last refreshed
    if TYPE_CHECKING:  # (SqliteRecords': the file's changes, which call file_changed)
        def record_wakeup(self) -> asyncio.Event | None: ...

    def count(self, increments: Iterable[Increment]) -> None:
        """Add to the pending batch; it is written within `FLUSH_DELAY` with whatever
        else was counted meanwhile (one transaction for a busy worker's many calls)."""
        self.view.add(increments)
        self._schedule_flush()

    def settle(self, holder: str, increments: Iterable[Increment]) -> None:
        """A settlement: written with the next batch, in its transaction, if `holder`'s
        lease is still in the file then (else dropped: its reservations were charged)."""
        self.view.add_settling(holder, increments)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                asyncio.get_running_loop().call_later(FLUSH_DELAY, self.flush)
            except RuntimeError:  # no loop (a tool, a test): now
                self.flush()

    def counter(self, table: str, field: str) -> int:
        return (self._stored(table, field) or 0) + self.view.unwritten(table, field)

    def _stored(self, table: str, field: str) -> int | None:
        """The file's value (None: it cannot be read)."""
        try:
            row = self._db().execute(
                "SELECT value FROM counters WHERE tbl = ? AND field = ? AND expires_at > ?",
                (table, field, self.clock())).fetchone()
        except sqlite3.Error as exc:
            self._failed("read", exc)
            return None
        return int(row[0]) if row else 0

    async def counter_tables(self, tables: Sequence[str]) -> dict[str, Table]:
        """Whole tables as the file has them once every process has written what it
        counted (they write within `FLUSH_DELAY`): a call that ended anywhere is in."""
        await asyncio.sleep(FLUSH_DELAY + 0.005)
        self.flush()
        now = self.clock()
        out: dict[str, Table] = {}
        try:
            for table in tables:
                rows = self._db().execute(
                    "SELECT field, value FROM counters WHERE tbl = ? AND expires_at > ?",
                    (table, now)).fetchall()
                if rows:
                    out[table] = {f: int(v) for f, v in rows}
        except sqlite3.Error as exc:
            self._failed("read", exc)
        for table in tables:  # (what could not be written is still counted)
            if self.view.has_unwritten(table):
                out[table] = self.view.table(table, out.get(table, {}))
        return out

    @property
    def counters_degraded(self) -> bool:
        return self._problem is not None

    def flush(self) -> None:
        """Write the pending counter batch (and held changes) in one transaction."""
        self._flush_scheduled = False
        if self._held:
            self._write_held()
        if (not self.view.pending and not self.view.settling) or self._conn is None:
            return
        try:
            with self.view.sending() as (batch, settling):
                dropped = self._counters_txn(self._rows(batch), {
                    holder: self._rows(tables) for holder, tables in settling.items()})
        except sqlite3.Error as exc:
            self._failed("counters", exc)
            return
        self._recovered()
        for holder in dropped:
            self._settlements_dropped(holder)

    def _rows(self, batch: dict[str, Table]) -> list[tuple[str, str, int, float]]:
        return [(table, field, amount, self.view.expires.get(table, 0.0))
                for table, fields in batch.items() for field, amount in fields.items()]

    def _counters_txn(self, rows: list[tuple[str, str, int, float]],
                      settling: dict[str, list[tuple[str, str, int, float]]]) -> list[str]:
        """The batch, and each holder's settlements if its lease stands; the holders
        whose settlements were dropped."""
        dropped = []
        with transaction(self._db()) as conn:
            conn.executemany(_ADD, rows)
            for holder, settled in settling.items():
                if conn.execute("SELECT 1 FROM leases WHERE holder = ?",
                                (holder,)).fetchone() is None:
                    dropped.append(holder)
                else:
                    conn.executemany(_ADD, settled)
        return dropped

    # -- leases (`leases.LeaseStore`; `holder`, `take_lease`: `LeaseHolding`) -------------

    async def lease_claim(self, holder: str, slot: str, ttl: float, takeover: bool) -> bool:
        try:
            with transaction(self._db()) as conn:
                if takeover:  # (and the shares of the process before it there)
                    conn.execute("UPDATE leases SET expires_at = 0 WHERE slot = ? AND "
                                 "holder != ?", (slot, holder))
                    conn.execute("DELETE FROM shares WHERE slot = ? AND holder != ?",
                                 (slot, holder))
                conn.execute("INSERT INTO leases (holder, slot, expires_at) VALUES (?, ?, ?) "
                             "ON CONFLICT(holder) DO UPDATE SET expires_at = "
                             "excluded.expires_at", (holder, slot, self.clock() + ttl))
        except sqlite3.Error as exc:
            self._failed("lease", exc)
            return False
        self._recovered()
        return True

    async def lease_renew(self, holder: str, ttl: float) -> bool | None:
        try:
            with transaction(self._db()) as conn:
                kept = conn.execute("UPDATE leases SET expires_at = ? WHERE holder = ?",
                                    (self.clock() + ttl, holder)).rowcount == 1
        except sqlite3.Error as exc:
            self._failed("lease", exc)
            return None
        self._recovered()
        return kept

    async def lease_reap(self, release: str | None) -> list[Charged] | None:
        """One transaction: every record of a holder without a live lease charged as
        used and deleted, with the dead leases (and `release`'s)."""
        now = self.clock()
        try:
            with transaction(self._db()) as conn:
                if release is not None:
                    conn.execute("DELETE FROM leases WHERE holder = ?", (release,))
                live = {h for (h,) in conn.execute(
                    "SELECT holder FROM leases WHERE expires_at > ?", (now,))}
                self.processes = max(1, len(live))  # (live leases)
                charged = self._charge(conn, live, now)
                conn.execute("DELETE FROM leases WHERE expires_at <= ?", (now,))
        except sqlite3.Error as exc:
            self._failed("lease", exc)
            return None
        self._recovered()
        return charged

    @staticmethod
    def _charge(conn: sqlite3.Connection, live: set[str], now: float) -> list[Charged]:
        charged: list[Charged] = []
        gone: list[tuple[str, str]] = []
        for name, value in conn.execute("SELECT field, value FROM counters WHERE tbl = ?",
                                        (ORPHANS,)).fetchall():
            held = parse_held(name)
            if held is not None and held[0] in live:
                if value == 0:  # (settled: nothing to keep)
                    gone.append((ORPHANS, name))
                continue
            gone.append((ORPHANS, name))
            target = charge_of(held[2]) if held is not None else None
            if held is None or target is None or value <= 0:
                continue
            holder, table, field = held
            row = conn.execute("SELECT expires_at FROM counters WHERE tbl = ? AND field = ? "
                               "AND expires_at > ?", (table, field, now)).fetchone()
            if row is None:
                continue  # (its window is over)
            conn.executemany(_ADD, [(table, target, value, row[0]),
                                    (table, field, -value, row[0])])
            charged.append(Charged(holder, table, field, int(value)))
        conn.executemany("DELETE FROM counters WHERE tbl = ? AND field = ?", gone)
        return charged

    def admit(self, admission: Admission, *, share: bool = True) -> int | None:
        """Check `admission`'s limits against the committed counters and, if every one
        holds, write its increments, in one transaction: None if admitted, else the
        index of the first limit that refused it. When the file cannot be used, this
        process's share decides, or (``share`` False) ``StoreAway`` is raised."""
        self.flush()  # (what this process counted so far is in the file first)
        now = self.clock()
        if share:
            if not self.records.limits:  # (other processes' writes refresh its records)
                with contextlib.suppress(RuntimeError):
                    self.record_wakeup()
            self.records.track(admission, now)
        holder = None if self._closing else self.holder
        written: tuple[list[Any], list[tuple[str, str]]] = ([], [])
        due: list[Any] = []  # (the records sent: rolled back with the transaction)
        try:
            with transaction(self._db()) as conn:
                read: dict[tuple[str, str], int] = {}
                shares: dict[str, list[tuple[str, str]]] = {}

                def value(table: str, field: str) -> int:
                    read[(table, field)] = found = _value(conn.execute(
                        "SELECT value FROM counters WHERE tbl = ? AND field = ? AND "
                        "expires_at > ?", (table, field, now)).fetchone())
                    return found

                def held(limit: Limit) -> int:
                    key = key_of(*limit.fields[0])
                    if key not in shares:
                        shares[key] = conn.execute(
                            "SELECT holder, record FROM shares WHERE tbl = ?",
                            (key,)).fetchall()
                    return held_for_others(shares[key], holder or "",
                                           (f for _, f in limit.fields), limit.ceiling)

                if now >= self._processes_read + 1.0:  # (a process started lately)
                    self._processes_read = now
                    self.processes = max(1, conn.execute(
                        "SELECT count(*) FROM leases WHERE expires_at > ?",
                        (now,)).fetchone()[0])
                refused = first_refused(admission, value, held)
                self.others_held = 0
                if refused is None:
                    conn.executemany(_ADD, list(admission.increments))
                    for table, field, amount, _ in admission.increments:
                        if (table, field) in read:
                            read[(table, field)] += amount
                else:
                    self.others_held = held(admission.limits[refused])
                written = self._write_shares(conn, holder, read, now, due)
        except sqlite3.Error as exc:
            self.records.failed(due)
            # Cannot decide across processes: decide on the share the others leave this
            # process (`alone_records.decide_alone`; the outage is reported) and keep
            # the increments to write later.
            self._failed("admit", exc)
            if not share:
                raise StoreAway(f"the state file cannot be used ({exc})") from None
            refused = decide_alone(admission, self.records, holder, self._stored,
                                   self.view.unwritten, f"the state file cannot be used "
                                   f"({exc})")
            if refused is None:
                self.view.add(admission.increments)
            return refused
        self._recovered()
        self.records.answered(holder or "", written[0])
        self.records.forgotten(written[1])
        return refused

    def _write_shares(self, conn: sqlite3.Connection, holder: str | None,
                      read: dict[tuple[str, str], int], now: float,
                      due: list[Any]) -> tuple[list[Any], list[tuple[str, str]]]:
        """In an admission's transaction: this process's records of what it read (the
        values after the admission; ``due`` gets them), and the records it no longer
        holds deleted."""
        if holder is not None and self.lease is not None:
            self._serial += 1
            due += self.records.due(holder, _by_table(read), self.processes, now, self._serial)
            self.records.sent(holder, due)
            if due:
                conn.executemany(_SHARE, [
                    (key, holder, self.lease.slot, record.serial, record.encode(), expires)
                    for key, record, expires in due])
        stale = [] if self.view.pending else self.records.stale(now, self._closing)
        if stale:
            conn.executemany("DELETE FROM shares WHERE holder = ? AND tbl = ?", stale)
        return due, stale

    def file_changed(self) -> None:
        """The file was written: refresh this process's records soon (coalesced), so
        the others hold no more of the room than its share of what is left now."""
        if self.records.limits and not self._refresh_scheduled:
            self._refresh_scheduled = True  # (at most one each _REFRESH_EVERY)
            wait = max(_REFRESH, self._refreshed_at + _REFRESH_EVERY - time.monotonic())
            asyncio.get_running_loop().call_later(wait, self.refresh_shares)

    def refresh_shares(self) -> None:
        """Write this process's records again if what it reads now changed them (on a
        change of the file, and every second)."""
        self._refresh_scheduled = False
        self._refreshed_at = time.monotonic()
        holder = None if self._closing else self.holder
        if holder is None or not self.records.limits or self._conn is None:
            return
        now = self.clock()
        due: list[Any] = []
        try:
            conn = self._db()
            read = {(table, field): _value(conn.execute(
                "SELECT value FROM counters WHERE tbl = ? AND field = ? AND expires_at > ?",
                (table, field, now)).fetchone())
                for table, fields in self.records.fields().items() for field in fields}
            if not self.records.due(holder, _by_table(read), self.processes, now, self._serial + 1):
                return
            with transaction(conn) as txn:
                written = self._write_shares(txn, holder, read, now, due)
        except sqlite3.Error as exc:
            self.records.failed(due)
            self._failed("counters", exc)
            return
        self.records.answered(holder, written[0])
        self.records.forgotten(written[1])

    def forget_shares(self) -> None:
        """Delete the records this process no longer holds (all of them once it is
        closing): what it spent alone under them is written (its batch went first)."""
        stale = self.records.stale(self.clock(), self._closing)
        if not stale or self._conn is None:
            return
        try:
            with transaction(self._db()) as conn:
                conn.executemany("DELETE FROM shares WHERE holder = ? AND tbl = ?", stale)
        except sqlite3.Error as exc:
            self._failed("counters", exc)
            return
        self.records.forgotten(stale)



def _by_table(read: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    known: dict[str, dict[str, int]] = {}  # (table -> field -> value)
    for (table, field), found in read.items():
        known.setdefault(table, {})[field] = found
    return known


def _value(row: tuple[Any, ...] | None) -> int:
    return int(row[0]) if row else 0
