"""Budgets: usage limits per sandbox or per policy over fixed windows (engine-independent).

``BudgetBook.check`` runs before a request is forwarded and refuses it once any budget
that applies is used up (used >= limit); ``record`` runs after the response, so the
request that crosses a limit completes and is counted. Both are synchronous and do no
I/O: they read and add to the state store's local counter view
(``gateway.services.state.counters``), which the store shares with the other
workers/replicas in the background.

Windows are fixed: ``floor(now / window) * window`` from the Unix epoch (so a day
multiple starts at 00:00 UTC), or calendar months in UTC for ``window: month``.

What counts: ``requests`` every recorded exchange (errors included: each one reached the
provider); ``tokens`` input + output tokens the response reported (unknown = 0);
``cost_usd`` the price of those tokens from the pricing file (a model without a price
counts 0 and is logged once). Counters are kept per deciding policy, so an inherited
budget is a separate allowance in each policy that extends it.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gateway.core.metering.pricing import Pricing
from gateway.core.metering.refusals import (
    RETRY_AFTER_MAX,
    BudgetExceeded,
    LimitKind,
    MeteringRefusal,
    iso_time,
    store_away,
)
from gateway.core.metering.usage import Usage
from gateway.core.policy.compiled import Policy
from gateway.core.policy.model import Budget
from gateway.services.state.counters import Admission, Counters, Increment, Limit, StoreAway
from gateway.services.state.leases import ORPHANS, held_field

__all__ = ["RETRY_AFTER_MAX", "BudgetBook", "BudgetExceeded", "budget_problems",
           "window_bounds"]

log = logging.getLogger("sandbox_gateway.metering")

NANO = 1_000_000_000  # cost is counted in nano-USD (integer counters)
_GRACE = 3600.0  # counters outlive their window by this much (status of the last window)
_HELD_RETRY = 5.0  # a budget only held by running calls: retry after this many seconds


def window_bounds(window: int | Literal["month"], now: float) -> tuple[float, float]:
    """The ``[start, end)`` of the window containing ``now`` (Unix seconds)."""
    if window == "month":
        at = dt.datetime.fromtimestamp(now, dt.UTC)
        first = at.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        nxt = (first.replace(year=first.year + 1, month=1) if first.month == 12
               else first.replace(month=first.month + 1))
        return first.timestamp(), nxt.timestamp()
    start = math.floor(now / window) * window
    return float(start), float(start + window)


@dataclass(frozen=True, slots=True)
class Reservation:
    """What one call may use at most: reserved against ``tokens`` and ``cost_usd``
    budgets when it is admitted, settled to its real use when it ends."""

    tokens: int = 0
    nano_usd: int = 0  # cost in nano-USD


@dataclass(frozen=True, slots=True)
class Hold:
    """A call's reservation as counted: ``(table, subject, expires_at)`` of every budget
    it counts against, what was reserved there, and the ``holder`` (the admitting
    process's lease, ``gateway.services.state.leases``) it is recorded under (None: no
    lease, a process without one)."""

    places: tuple[tuple[str, str, float], ...]
    reserved: Reservation
    holder: str | None = None


_NO_RESERVATION = Reservation()


class BudgetBook:
    """Checks, reserves and records budget use in the state store's counters.

    Fields of a budget window's table, per subject (a sandbox or the policy): ``r``
    requests, ``t`` tokens and ``c`` nano-USD settled, ``rt`` and ``rc`` tokens and
    nano-USD reserved by calls still running."""

    def __init__(self, counters: Counters, pricing: Pricing | None = None, *,
                 share: bool = True) -> None:
        self.counters = counters
        self.pricing = pricing
        # While the store cannot decide across processes: this process's share decides
        # (`state.unavailable: serve`), or budgeted calls are refused 503 (`refuse`).
        self.share = share
        self._unpriced: set[str] = set()

    @staticmethod
    def applicable(policy: Policy, credential: str) -> list[Budget]:
        """The budgets of ``policy`` that requests on ``credential`` count against."""
        return [b for b in policy.budgets if b.applies_to(credential)]

    @staticmethod
    def limits_usage(policy: Policy, credential: str) -> bool:
        """True if a ``tokens`` or ``cost_usd`` budget of ``policy`` counts calls on
        ``credential``: their usage must then be read (or the call refused)."""
        return any((b.tokens is not None or b.cost_usd is not None) and b.applies_to(credential)
                   for b in policy.budgets)

    @staticmethod
    def _table(policy: str, budget: Budget, start: float) -> str:
        return f"b:{policy}:{budget.name}:{int(start)}"

    @staticmethod
    def _subject(budget: Budget, sandbox: str, policy: str) -> str:
        return sandbox if budget.per == "sandbox" else policy

    def _used(self, table: str, subject: str) -> tuple[dict[LimitKind, float],
                                                       dict[LimitKind, float]]:
        """(settled, held): what was used, and what running calls hold."""
        read = self.counters.counter
        used: dict[LimitKind, float] = {
            "tokens": read(table, "t:" + subject), "requests": read(table, "r:" + subject),
            "cost_usd": read(table, "c:" + subject) / NANO}
        held: dict[LimitKind, float] = {
            "tokens": max(0, read(table, "rt:" + subject)), "requests": 0,
            "cost_usd": max(0, read(table, "rc:" + subject)) / NANO}
        return used, held

    def check(self, sandbox: str, policy: Policy, credential: str, now: float, *,
              reserve: Reservation = _NO_RESERVATION,
              open_session: Usage | None = None) -> BudgetExceeded | None:
        """None if every applicable budget has room for this call; else the one that
        refuses it and resets last (the earliest time it could be allowed).

        A budget has room when what was used plus what running calls hold plus this
        call's ``reserve`` stays within each limit (``requests``: one more request).
        ``open_session``: what a session still open (a Realtime WebSocket) has used so
        far, not yet recorded: its tokens and cost count on top of the recorded use, and
        ``requests`` limits do not apply (the session was counted when admitted)."""
        worst: BudgetExceeded | None = None
        extra_tokens = extra_cost = 0.0
        if open_session is not None:
            extra_tokens = open_session.tokens
            if any(b.cost_usd is not None for b in policy.budgets):
                extra_cost = self.cost(open_session) or 0.0
        asked: dict[LimitKind, float] = {"tokens": reserve.tokens, "requests": 1,
                                         "cost_usd": reserve.nano_usd / NANO}
        for budget in policy.budgets:
            if not budget.applies_to(credential):
                continue
            start, end = window_bounds(budget.window, now)
            subject = self._subject(budget, sandbox, policy.name)
            used, held = self._used(self._table(policy.name, budget, start), subject)
            limits: tuple[tuple[LimitKind, float | None], ...] = (
                ("tokens", budget.tokens), ("requests", budget.requests),
                ("cost_usd", budget.cost_usd))
            if open_session is not None:
                used["tokens"] += extra_tokens
                used["cost_usd"] += extra_cost
                limits = (limits[0], limits[2])
            for kind, limit in limits:
                if limit is None:
                    continue
                if kind == "requests":
                    if used[kind] < limit:
                        continue
                elif used[kind] + held[kind] + asked[kind] <= limit and \
                        used[kind] + held[kind] < limit:
                    continue
                resets = end
                if held[kind] and used[kind] + asked[kind] <= limit:
                    resets = min(end, now + _HELD_RETRY)  # room again once calls settle
                if worst is None or math.ceil(resets - now) > worst.frees_in:
                    worst = BudgetExceeded(budget, subject, kind, used[kind], limit, start,
                                           end, max(1, math.ceil(resets - now)), held[kind],
                                           asked[kind] if kind != "requests" else 0,
                                           max(1, math.ceil(end - now)))
                break
        return worst

    def cost(self, usage: Usage) -> float | None:
        """The USD cost of ``usage`` (None without pricing or a price for its model)."""
        if self.pricing is None:
            return None
        cost = self.pricing.cost(usage)
        name = usage.model or ""
        if cost is None and usage.known and name not in self._unpriced:
            if len(self._unpriced) < 1000:
                self._unpriced.add(name)
            log.warning("metering: model %r has no price in %s; its cost counts as 0",
                        usage.model, self.pricing.source)
        return cost

    def reservation(self, policy: Policy, credential: str, model: str | None,
                    input_tokens: int, output_tokens: int) -> Reservation | str:
        """The reservation of a call that may use ``input_tokens`` + ``output_tokens``
        (its cost at the model's prices), or why it cannot be priced (a ``cost_usd``
        budget and a model without a price: the call cannot be counted)."""
        nano = 0
        if any(b.cost_usd is not None and b.applies_to(credential) for b in policy.budgets):
            if self.pricing is None:
                return ("metering.pricing is not configured, so a cost_usd budget cannot "
                        "count this call; set metering.pricing in the gateway config")
            if self.pricing.price(model) is None:
                return (f'model "{(model or "unknown")[:100]}" has no price in '
                        f"{self.pricing.source}, so a cost_usd budget cannot count this "
                        "call; add the model to the pricing file")
            price = self.pricing.price(model)
            assert price is not None
            nano = math.ceil(price.bound(input_tokens, output_tokens) * NANO)
        return Reservation(input_tokens + output_tokens, nano)

    def admit(self, sandbox: str, policy: Policy, credential: str, now: float,
              reserve: Reservation = _NO_RESERVATION, *,
              requests: int = 1,
              again: bool = False) -> BudgetExceeded | MeteringRefusal | Hold | None:
        """Check every applicable budget and count the call against them, as one step
        of the state store (one transaction across the host's processes with SQLite),
        before it is forwarded: refused (the budget that refused it, as ``check`` words
        it), or counted - one request, and its reservation held until ``settle``
        (None: no budget counts it). A burst of parallel calls meets every limit
        without waiting for any of them to complete.

        The reservation is also recorded under this process's lease (the counters'
        ``holder``), in the same step: if the process dies before the call settles,
        a live one charges the reservation in full as used. While the store cannot
        decide across processes, this process's share of each budget's room decides
        (``counters.first_refused_alone``; the refusal says so), or, without ``share``
        (``state.unavailable: refuse``), the call is refused ``503 state_unavailable``.
        ``again``: the second try after a refusal ``check`` found room for (what refused
        it settled)."""
        places: list[tuple[str, str, float]] = []
        increments: list[Increment] = []
        limits: list[Limit] = []
        owners: list[tuple[Budget, str, LimitKind, float, float, float]] = []  # by limit
        holder = self.counters.holder
        for budget in self.applicable(policy, credential):
            start, end = window_bounds(budget.window, now)
            table = self._table(policy.name, budget, start)
            subject = self._subject(budget, sandbox, policy.name)
            expires = end + _GRACE
            places.append((table, subject, expires))
            if requests:
                increments.append((table, "r:" + subject, requests, expires))
            for field, amount in (("rt:" + subject, reserve.tokens),
                                  ("rc:" + subject, reserve.nano_usd)):
                if amount:
                    increments.append((table, field, amount, expires))
                    if holder is not None:
                        increments.append((ORPHANS, held_field(holder, table, field),
                                           amount, expires))
            if budget.tokens is not None:
                limits.append(Limit(((table, "t:" + subject), (table, "rt:" + subject)),
                                    budget.tokens, reserve.tokens))
                owners.append((budget, subject, "tokens", reserve.tokens, start, end))
            if budget.requests is not None and requests:
                limits.append(Limit(((table, "r:" + subject),), budget.requests, requests))
                owners.append((budget, subject, "requests", 0, start, end))
            if budget.cost_usd is not None:
                limits.append(Limit(((table, "c:" + subject), (table, "rc:" + subject)),
                                    round(budget.cost_usd * NANO), reserve.nano_usd))
                owners.append((budget, subject, "cost_usd", reserve.nano_usd / NANO, start,
                               end))
        if not places:
            return None
        try:
            refused = self.counters.admit(Admission(tuple(limits), tuple(increments)),
                                          share=self.share)
        except StoreAway:
            return store_away(self.applicable(policy, credential)[0], self.share)
        if refused is None:
            return Hold(tuple(places), reserve, holder)
        exceeded = self.check(sandbox, policy, credential, now, reserve=reserve)
        if exceeded is not None:
            return exceeded
        degraded = self.counters.counters_degraded
        if not degraded and not again:  # (what refused it settled meanwhile): once more
            return self.admit(sandbox, policy, credential, now, reserve, requests=requests,
                              again=True)
        # Refused by this process's share of the room while the store is away
        # (`counters.first_refused_alone`), or twice by a store whose readings said there
        # was room: the limit that refused it, as it reads here.
        budget, subject, kind, asked, start, end = owners[refused]
        used, held = self._used(self._table(policy.name, budget, start), subject)
        return BudgetExceeded(budget, subject, kind, used[kind], _limit(budget, kind), start,
                              end, max(1, math.ceil(min(end - now, _HELD_RETRY))), held[kind],
                              asked, max(1, math.ceil(end - now)),
                              alone=self.counters.processes if degraded else 0,
                              others=0 if degraded else self.counters.others_held)

    def settle(self, hold: Hold, tokens: int, nano_usd: int) -> None:
        """A held call ended: its reservation is released and what it used counted, in
        the windows it was admitted in. Both, and the reservation's record under its
        holder, are written together (one transaction or script), and only while the
        holder's lease stands: a call is charged what it used or, if its process was
        found dead first, its reservation - never both, never neither."""
        increments: list[Increment] = []
        reserved = hold.reserved
        holder = hold.holder
        for table, subject, expires in hold.places:
            if tokens:
                increments.append((table, "t:" + subject, tokens, expires))
            if nano_usd:
                increments.append((table, "c:" + subject, nano_usd, expires))
            for field, amount in (("rt:" + subject, reserved.tokens),
                                  ("rc:" + subject, reserved.nano_usd)):
                if amount:
                    increments.append((table, field, -amount, expires))
                    if holder is not None:
                        increments.append((ORPHANS, held_field(holder, table, field),
                                           -amount, expires))
        if not increments:
            return
        if holder is not None and (reserved.tokens or reserved.nano_usd):
            self.counters.settle(holder, increments)
        else:
            self.counters.count(increments)

    def record(self, sandbox: str, policy: Policy, credential: str, usage: Usage,
               now: float) -> None:
        """Count what a call used that reserved nothing (a response a Realtime session
        made on its own) against every applicable budget."""
        budgets = self.applicable(policy, credential)
        if not budgets:
            return
        cost = self.cost(usage) if any(b.cost_usd is not None for b in budgets) else None
        tokens = usage.tokens
        increments: list[Increment] = []
        for budget in budgets:
            start, end = window_bounds(budget.window, now)
            table = self._table(policy.name, budget, start)
            subject = self._subject(budget, sandbox, policy.name)
            expires = end + _GRACE
            if tokens:
                increments.append((table, "t:" + subject, tokens, expires))
            if cost:
                increments.append((table, "c:" + subject, round(cost * NANO), expires))
        if increments:
            self.counters.count(increments)

    async def status(self, policy: Policy, sandbox: str | None,
                     now: float) -> list[dict[str, Any]]:
        """Current use of ``policy``'s budgets (per-sandbox ones only with ``sandbox``),
        read fresh from the store, for the admin API."""
        wanted: list[tuple[Budget, str, float, float, str]] = []
        for budget in policy.budgets:
            if budget.per == "sandbox" and sandbox is None:
                continue
            start, end = window_bounds(budget.window, now)
            subject = self._subject(budget, sandbox or "", policy.name)
            wanted.append((budget, self._table(policy.name, budget, start), start, end, subject))
        tables = await self.counters.counter_tables(sorted({w[1] for w in wanted}))
        out: list[dict[str, Any]] = []
        for budget, table, start, end, subject in wanted:
            fields = tables.get(table, {})
            used = {"tokens": fields.get("t:" + subject, 0),
                    "requests": fields.get("r:" + subject, 0),
                    "cost_usd": fields.get("c:" + subject, 0) / NANO}
            reserved = {"tokens": max(0, fields.get("rt:" + subject, 0)),
                        "cost_usd": max(0, fields.get("rc:" + subject, 0)) / NANO}
            limits = {"tokens": budget.tokens, "requests": budget.requests,
                      "cost_usd": budget.cost_usd}
            exceeded = any(v is not None and used[k] + reserved.get(k, 0) >= v
                           for k, v in limits.items())
            out.append({
                "policy": policy.name, "budget": budget.name, "source": budget.source,
                "per": budget.per, "subject": subject, "window": budget.window_text,
                "window_start": iso_time(start), "resets_at": iso_time(end),
                "used": used, "settled": used, "reserved": reserved,
                "limits": {k: v for k, v in limits.items() if v is not None},
                "exceeded": exceeded,
            })
        return out


def budget_problems(policies: Sequence[Policy], pricing: Pricing | None) -> list[str]:
    """Budgets that cannot be enforced as written with this configuration."""
    if pricing is not None:
        return []
    return [f'{b.source}: budget "{b.name}" sets cost_usd but metering.pricing is not '
            "configured, so costs are unknown and every inference call it counts is "
            "refused (metering_unavailable); set metering.pricing in the gateway config"
            for p in policies for b in p.budgets if b.cost_usd is not None and b.policy == p.name]


def _limit(budget: Budget, kind: LimitKind) -> float:
    """A budget's ceiling of ``kind`` (as ``check`` compares it)."""
    value = {"tokens": budget.tokens, "requests": budget.requests,
             "cost_usd": budget.cost_usd}[kind]
    return float(value or 0)
