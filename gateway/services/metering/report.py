"""The ``GET /v1/usage`` answer: the ledger's rows and totals since a time, each budget's
status, whether the counters are degraded, and sums per hour or day over time."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

from gateway.core.metering.pricing import Pricing
from gateway.core.policy.compiled import PolicySet
from gateway.services.metering.budgets import BudgetBook
from gateway.services.metering.ledger import DAY, HOUR, UsageLedger, totals
from gateway.services.state.counters import Counters

__all__ = ["usage_report"]


async def usage_report(ledger: UsageLedger, book: BudgetBook, counters: Counters,
                       pricing: Pricing | None, policy_set: PolicySet, *,
                       sandbox: str | None, policy: str | None, since: float | None,
                       now: float, by: str | None = None) -> dict[str, Any]:
    """The ``GET /v1/usage`` answer: rows, totals, budget status, degraded flag;
    with ``by`` (``hour`` or ``day``) also ``series``, the sums per bucket over time
    (``start`` an ISO time; ``cost_usd`` None without pricing)."""
    step = _STEPS.get(by) if by is not None else None
    if by is not None and step is None:
        raise ValueError(f"by {by[:16]!r} is not hour or day")
    start = (math.floor(since / 3600) * 3600 if since is not None
             else math.floor((now - ledger.retention) / 3600) * 3600)
    rows, series = await ledger.summary(sandbox=sandbox, policy=policy, since=start,
                                        now=now, step=step)
    if pricing is None:
        for row in (*rows, *series):
            row["cost_usd"] = None
    names = [policy] if policy is not None else sorted({r["policy"] for r in rows})
    budgets: list[dict[str, Any]] = []
    for name in names:
        found = policy_set.get(name)
        if found is not None:
            budgets.extend(await book.status(found, sandbox, now))
    summed = totals([{**r, "cost_usd": r["cost_usd"] or 0} for r in rows])
    if pricing is None:
        summed["cost_usd"] = None
    out = {
        "since": _iso(start), "until": _iso(now), "sandbox": sandbox, "policy": policy,
        "degraded": counters.counters_degraded,
        "totals": summed, "rows": rows, "budgets": budgets,
    }
    if step is not None:
        out["by"] = by
        out["series"] = [{**b, "start": _iso(b["start"])} for b in series]
    return out


_STEPS = {"hour": HOUR, "day": DAY}


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
