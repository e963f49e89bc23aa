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

from gateway.services.state.alone_records import Record, key_of
from gateway.services.state.counters import Admission, Increment
from gateway.services.state.leases import ORPHANS

__all__ = ["ANSWERED_LIFE_MS", "MARK_LIFE_MS", "SCRIPT", "Shares", "Write", "WriteCall",
           "expiry"]

MARK_LIFE_MS = 86_400_000  # a write's mark, until it is resolved
ANSWERED_LIFE_MS = 60_000  # the mark of a write that was answered

# Every write: the pending batch, settlements, an admission, reads. ARGV: this write's
# mark (key index) and the marks' life (ms); the marks of answered writes to keep only a
# minute more (n, key index and ms each); the unsure writes (n, then per write: its
# mark's key index, 1 if this replica admitted its call (0: refused, or no admission),
# its batch, its settlements, its admission's increments); the pending batch (n, then
# key index, field, amount, expiry per entry); the pending settlements (n holders, then
# per holder: its lease's key index and a batch, applied only if the lease key exists);
# the writer's holder ('' : none); the limits (n, then per limit: n fields, key index
# and field per field, ceiling, add, the key index of its table's records (0: none): the
# records of the other holders add their shares to what it used); the admission's
# increments (like the batch); the writer's records (the key index of its tables' index
# (0: none), n, then per record: its hash's key index, serial, JSON, expiry; kept only
# over a lower serial); the records to delete (n, key index and holder each); the key
# index of the leases' index (0: none); the fields to report (n, key index and field
# each). Returns {-1} if the write was
# resolved already (it never runs then), else {refused limit (1-based) or 0, the other
# holders' shares that limit counted, the processes listed in the leases' index (0: not
# asked), n dropped settlements, their numbers in order...,
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
local me = take()
local shares = {}
local function read(text)
  local ok, record = pcall(cjson.decode, text)
  if ok and type(record) == 'table' and type(record.v) == 'table'
      and type(record.d) == 'table' and type(record.n) == 'number' then
    return record
  end
  return false
end
local function one(record, names, ceiling)
  if not record then return ceiling end  -- (unreadable: it may be a share)
  local base = 0
  for _, name in ipairs(names) do
    local value = tonumber(record.v[name])
    if value == nil then return 0 end  -- (it cannot decide alone on this limit)
    base = base + value
  end
  local cap = tonumber(record.d[names[1]])
  if cap == nil or ceiling <= base then return 0 end
  return math.min(cap, math.floor((ceiling - base) / math.max(1, record.n)))
end
local function held(index, names, ceiling)
  if index == 0 then return 0 end
  local found = shares[index]
  if not found then
    found = {}
    local all = redis.call('HGETALL', KEYS[index])
    for i = 1, #all, 2 do
      if all[i] ~= me then found[#found + 1] = read(all[i + 1]) end
    end
    shares[index] = found
  end
  local out = 0
  for _, record in ipairs(found) do out = out + one(record, names, ceiling) end
  return out
end
local refused = 0
local others = 0
for i = 1, tonumber(take()) do
  local used = 0
  local names = {}
  for _ = 1, tonumber(take()) do
    local key = KEYS[tonumber(take())]
    local field = take()
    names[#names + 1] = field
    used = used + (tonumber(redis.call('HGET', key, field)) or 0)
  end
  local ceiling = tonumber(take())
  local add = tonumber(take())
  local records = tonumber(take())
  if refused == 0 then
    local shares = held(records, names, ceiling)
    if not (used + shares < ceiling and used + shares + add <= ceiling) then
      refused = i
      others = shares
    end
  end
end
if refused == 0 then apply(1) else apply(0) end
redis.call('SET', mark, refused, 'PX', life)
local index = tonumber(take())
for _ = 1, tonumber(take()) do
  local key = KEYS[tonumber(take())]
  local serial = tonumber(take())
  local record = take()
  local expires = tonumber(take())
  local old = redis.call('HGET', key, me)
  old = old and read(old)
  if not old or not (tonumber(old.s) and tonumber(old.s) >= serial) then
    redis.call('HSET', key, me, record)
    if expires > 0 then redis.call('EXPIREAT', key, expires) end
  end
  redis.call('SADD', KEYS[index], me .. string.char(31) .. key)
  redis.call('PEXPIRE', KEYS[index], life)
end
for _ = 1, tonumber(take()) do
  local key = KEYS[tonumber(take())]
  local holder = take()
  redis.call('HDEL', key, holder)
  if index > 0 then redis.call('SREM', KEYS[index], holder .. string.char(31) .. key) end
end
local leases = tonumber(take())
local processes = 0
if leases > 0 then processes = redis.call('HLEN', KEYS[leases]) end
local out = {refused, others, processes, #dropped}
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


@dataclass(frozen=True, slots=True)
class Shares:
    """What a write carries of the processes' shares (``alone_records``): the writer's
    ``holder`` ('' : none; the others' records are what its admission leaves alone),
    the records' hashes (``prefix`` + table), the index of the records made in its slot
    (``index``; '': no lease), its ``records`` and the records it deletes (``forget``:
    holder, table)."""

    prefix: str
    holder: str
    index: str = ""
    records: tuple[tuple[str, Record, float], ...] = ()
    forget: tuple[tuple[str, str], ...] = ()
    leases: str = ""  # the leases' index: how many processes hold one ('': not asked)


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
    shares: Shares = field(default_factory=lambda: Shares("", ""))
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
        shares = self.shares
        self.args.append(shares.holder)
        limits = admission.limits if admission is not None else ()
        self.args.append(len(limits))
        for limit in limits:
            self.args.append(len(limit.fields))
            for table, name in limit.fields:
                self.args += [self._key(self.prefix + table), name]
            self.args += [limit.ceiling, limit.add,
                          self._key(shares.prefix + key_of(*limit.fields[0]))
                          if limit.fields else 0]
        self._entries(self.write.admission)
        self.args.append(self._key(shares.index) if shares.index else 0)
        self.args.append(len(shares.records))
        for table, record, expires in shares.records:
            self.args += [self._key(shares.prefix + table), record.serial, record.encode(),
                          expiry(table, expires)]
        self.args.append(len(shares.forget))
        for holder, table in shares.forget:
            self.args += [self._key(shares.prefix + table), holder]
        self.args.append(self._key(shares.leases) if shares.leases else 0)
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
