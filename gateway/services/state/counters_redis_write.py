"""One write of the Redis counters, exactly once even when its answer never comes.

Everything a replica writes to its counters - the pending batch, the settlements, a
budget admission, and the reads that refresh its view - goes in one Lua script
(``SCRIPT``) that Redis runs atomically. A write's answer can be lost after Redis ran
it: Redis stalled past the client's timeout (a loaded machine descheduled it) and ran
the script when it resumed, or the connection broke after the script was sent. Sending
the write again would count it twice; dropping it would lose it if it never ran. So
each write carries a **mark** (a key named for this replica and the write): the script
does nothing if its mark exists, and sets it to its outcome when it runs. A write
whose answer never came is kept by the replica as **unsure** (``Write``) and carried by
every later write until one is answered; that one **resolves** it in the same script:

* mark absent: it never ran - its batch and settlements are applied now, its
  admission's increments if this replica's view admitted the call (it was forwarded),
  and the mark set ``resolved``, so the late copy, should it still arrive, does nothing;
* mark is its outcome: it ran - nothing of it is applied again, but the admission is
  reconciled with what this replica decided meanwhile: Redis admitted a call this
  replica refused, its increments are taken back; Redis refused a call this replica
  admitted (and forwarded), they are counted;
* ``resolved``: another write that carried it (sent while the first was on its way)
  resolved it already: nothing.

A mark lives ``MARK_LIFE_MS`` (a day: the longest a write can stay unsure and still be
resolved exactly once); the mark of an answered write is kept ``ANSWERED_LIFE_MS`` more
(a copy of it still in Redis's socket then finds it), told by the next write.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.services.state.counters import Admission, Increment
from gateway.services.state.leases import ORPHANS

__all__ = ["ANSWERED_LIFE_MS", "MARK_LIFE_MS", "SCRIPT", "Write", "WriteCall", "expiry"]

MARK_LIFE_MS = 86_400_000  # a write's mark, until it is resolved
ANSWERED_LIFE_MS = 60_000  # the mark of a write that was answered

# Every write: the pending batch, settlements, an admission, reads. ARGV: this write's
# mark (key index) and the marks' life (ms); the marks of answered writes to keep only a
# minute more (n, key index and ms each); the unsure writes (n, then per write: its
# mark's key index, 1 if this replica admitted its call (0: refused, or no admission),
# its batch, its settlements, its admission's increments); the pending batch (n, then
# key index, field, amount, expiry per entry); the pending settlements (n holders, then
# per holder: its lease's key index and a batch, applied only if the lease key exists);
# the limits (n, then per limit: n fields, key index and field per field, ceiling,
# add); the admission's increments (like the batch); the fields to report (n, key index
# and field each). Returns {-1} if the write was resolved already (it never runs then),
# else {refused limit (1-based) or 0, n dropped settlements, their numbers in order...,
# reported values...}. A mark is absent until its write runs, then the write's refused
# limit ('0': admitted, or no admission), then 'resolved' once a later write resolved
# it (the content of a write that never ran applied then, once).
# (Explicit locals: Lua leaves the order of evaluation of a call's arguments unspecified.)
SCRIPT = """
local at = 0
local function take() at = at + 1 return ARGV[at] end
local function apply(times)
  for _ = 1, tonumber(take()) do
    local key = KEYS[tonumber(take())]
    local field = take()
    local amount = take()
    local expires = tonumber(take())
    if times ~= 0 then
      if times < 0 then
        if string.sub(amount, 1, 1) == '-' then amount = string.sub(amount, 2)
        else amount = '-' .. amount end
      end
      redis.call('HINCRBY', key, field, amount)
      if expires > 0 then redis.call('EXPIREAT', key, expires) end
    end
  end
end
local groups = 0
local dropped = {}
local function settle(run)
  for _ = 1, tonumber(take()) do
    local lease = KEYS[tonumber(take())]
    groups = groups + 1
    if run and redis.call('EXISTS', lease) == 1 then apply(1) else
      if run then dropped[#dropped + 1] = groups end
      apply(0)
    end
  end
end
local mark = KEYS[tonumber(take())]
local life = take()
if redis.call('EXISTS', mark) == 1 then return {-1} end
for _ = 1, tonumber(take()) do
  local answered = KEYS[tonumber(take())]
  redis.call('PEXPIRE', answered, take())
end
for _ = 1, tonumber(take()) do
  local unsure = KEYS[tonumber(take())]
  local here = tonumber(take())
  local state = redis.call('GET', unsure)
  if state == 'resolved' then
    apply(0) settle(false) apply(0)
  elseif state then
    apply(0) settle(false)
    if state == '0' then apply(here - 1) else apply(here) end
  else
    apply(1) settle(true) apply(here)
  end
  redis.call('SET', unsure, 'resolved', 'PX', life)
end
apply(1)
settle(true)
local refused = 0
for i = 1, tonumber(take()) do
  local used = 0
  for _ = 1, tonumber(take()) do
    local key = KEYS[tonumber(take())]
    local field = take()
    used = used + (tonumber(redis.call('HGET', key, field)) or 0)
  end
  local ceiling = tonumber(take())
  local add = tonumber(take())
  if refused == 0 and not (used < ceiling and used + add <= ceiling) then refused = i end
end
if refused == 0 then apply(1) else apply(0) end
redis.call('SET', mark, refused, 'PX', life)
local out = {refused, #dropped}
for _, number in ipairs(dropped) do out[#out + 1] = number end
for _ = 1, tonumber(take()) do
  local key = KEYS[tonumber(take())]
  local field = take()
  out[#out + 1] = tonumber(redis.call('HGET', key, field)) or 0
end
return out
"""


@dataclass(frozen=True, slots=True)
class Write:
    """One write as sent: its mark and what it counts. Kept while ``unsure`` (its answer
    never came), with ``admitted_here``: this replica's view admitted the call it
    carried (so the call was forwarded)."""

    mark: str  # its key
    batch: tuple[Increment, ...]
    settling: tuple[tuple[str, tuple[Increment, ...]], ...]  # (holder, its settlements)
    admission: tuple[Increment, ...] = ()  # the admitted call's increments (): none
    admitted_here: bool = False

    def empty(self) -> bool:
        return not (self.batch or self.settling or self.admission)

    def counted(self) -> Iterator[Increment]:
        """What this replica counts of it while it is unsure."""
        yield from self.batch
        for _, entries in self.settling:
            yield from entries
        if self.admitted_here:
            yield from self.admission

    def fields(self) -> Iterator[tuple[str, str]]:
        """Every (table, field) it writes."""
        for table, name, _, _ in (*self.batch, *(e for _, es in self.settling for e in es),
                                  *self.admission):
            yield table, name


@dataclass
class WriteCall:
    """The KEYS and ARGV of one ``SCRIPT`` call, in the script's order (``build``), and
    what its answer means: ``holders`` the settlements' holders by number, ``report``
    the fields whose values it returns."""

    prefix: str  # of the counters' hashes
    lease_prefix: str
    write: Write
    carried: tuple[Write, ...]  # the unsure writes it resolves
    answered: tuple[str, ...]  # marks of answered writes, kept a minute more
    keys: dict[str, int] = field(default_factory=dict)
    args: list[Any] = field(default_factory=list)
    holders: list[str] = field(default_factory=list)
    report: list[tuple[str, str]] = field(default_factory=list)

    def build(self, admission: Admission | None,
              watched: dict[str, list[str]]) -> list[Any]:
        """``numkeys, *keys, *args`` for ``EVAL``."""
        self.args += [self._key(self.write.mark), MARK_LIFE_MS, len(self.answered)]
        for mark in self.answered:
            self.args += [self._key(mark), ANSWERED_LIFE_MS]
        self.args.append(len(self.carried))
        for unsure in self.carried:
            self.args += [self._key(unsure.mark), int(unsure.admitted_here)]
            self._counts(unsure)
        self._entries(self.write.batch)
        self._settlements(self.write.settling)
        limits = admission.limits if admission is not None else ()
        self.args.append(len(limits))
        for limit in limits:
            self.args.append(len(limit.fields))
            for table, name in limit.fields:
                self.args += [self._key(self.prefix + table), name]
            self.args += [limit.ceiling, limit.add]
        self._entries(self.write.admission)
        self.report = list(dict.fromkeys([
            *(f for w in (*self.carried, self.write) for f in w.fields()),
            *(f for limit in limits for f in limit.fields),
            *((table, name) for table, names in watched.items() for name in names)]))
        self.args.append(len(self.report))
        for table, name in self.report:
            self.args += [self._key(self.prefix + table), name]
        return [len(self.keys), *self.keys, *self.args]

    def _key(self, name: str) -> int:
        return self.keys.setdefault(name, len(self.keys) + 1)

    def _counts(self, write: Write) -> None:
        self._entries(write.batch)
        self._settlements(write.settling)
        self._entries(write.admission)

    def _entries(self, increments: Sequence[Increment]) -> None:
        self.args.append(len(increments))
        for table, name, amount, expires in increments:
            self.args += [self._key(self.prefix + table), name, amount, expiry(table, expires)]

    def _settlements(self, settling: Iterable[tuple[str, Sequence[Increment]]]) -> None:
        groups = list(settling)
        self.args.append(len(groups))
        for holder, entries in groups:
            self.holders.append(holder)
            self.args.append(self._key(self.lease_prefix + holder))
            self._entries(entries)


def expiry(table: str, expires: float) -> int:
    """A table's EXPIREAT (0: none; the reservations' records have none: they are
    emptied as calls settle and dead holders are charged)."""
    return 0 if table == ORPHANS or not expires else math.ceil(expires)
