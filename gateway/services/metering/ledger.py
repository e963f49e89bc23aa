"""Usage totals per policy, sandbox, credential and model, in hourly buckets.

Every completed inference exchange adds to the bucket of its hour (table ``u:<hour
start>`` in the state store's counters; field = JSON ``[policy, sandbox, credential,
model, kind]``). Buckets expire ``retention`` after their hour, so ``/v1/usage`` can
answer "since" any time within the retention, rounded down to the hour. Model names
pass through ``ModelNames`` (bounded: an agent cannot grow the store with made-up names).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from gateway.core.metering.usage import Usage
from gateway.services.state.counters import Counters

__all__ = ["DAY", "HOUR", "UsageLedger", "totals"]

HOUR = 3600
DAY = 86400
NANO = 1_000_000_000
# kind code -> output column
_KINDS = {"r": "requests", "n": "unknown_requests", "i": "input_tokens",
          "o": "output_tokens", "c": "cached_input_tokens", "$": "cost_usd"}
_KEY = ("policy", "sandbox", "credential", "model")


class UsageLedger:
    """Adds exchanges to hourly buckets and sums them back for the admin API."""

    def __init__(self, counters: Counters, *, retention: float = 7 * 86400) -> None:
        self.counters = counters
        self.retention = retention
        self._fields: dict[tuple[str, str, str, str], tuple[str, ...]] = {}  # encoded

    def record(self, sandbox: str, policy: str, credential: str, model: str, usage: Usage,
               cost_usd: float | None, now: float) -> None:
        """Count one exchange (no I/O); ``model`` is its label (``ModelNames``)."""
        hour = math.floor(now / HOUR) * HOUR
        table = f"u:{hour}"
        expires = hour + HOUR + self.retention
        # Each field is the JSON array [policy, sandbox, credential, model, kind]; an
        # exchange's six are encoded once per key and remembered (agents repeat keys).
        key = (policy, sandbox, credential, model)
        fields = self._fields.get(key)
        if fields is None:
            if len(self._fields) >= 4096:
                self._fields.clear()
            prefix = json.dumps(list(key), separators=(",", ":"))[:-1]
            fields = self._fields[key] = tuple(f'{prefix},"{kind}"]' for kind in _KINDS)
        amounts = (1, 0 if usage.known else 1, usage.input_tokens or 0,
                   usage.output_tokens or 0, usage.cached_input_tokens or 0,
                   round(cost_usd * NANO) if cost_usd else 0)
        self.counters.count([(table, field, amount, expires)
                             for field, amount in zip(fields, amounts, strict=True)
                             if amount])

    def tables(self, since: float, now: float) -> list[str]:
        """The buckets from ``since`` (clamped to the retention) to ``now``."""
        first = max(math.floor(since / HOUR), math.floor((now - self.retention) / HOUR))
        last = math.floor(now / HOUR)
        return [f"u:{h * HOUR}" for h in range(first, last + 1)]

    async def query(self, *, sandbox: str | None, policy: str | None, since: float,
                    now: float) -> list[dict[str, Any]]:
        """Rows summed over the buckets since ``since``, one per policy, sandbox,
        credential and model, filtered by ``sandbox`` / ``policy`` when given."""
        rows, _ = await self.summary(sandbox=sandbox, policy=policy, since=since, now=now)
        return rows

    async def series(self, *, sandbox: str | None, policy: str | None, since: float,
                     now: float, step: int = HOUR) -> list[dict[str, Any]]:
        """Sums per ``step`` (an hour or a day) from ``since`` to ``now``, empty buckets
        included, filtered like ``query``."""
        _, found = await self.summary(sandbox=sandbox, policy=policy, since=since, now=now,
                                      step=step)
        return found

    async def summary(self, *, sandbox: str | None, policy: str | None, since: float,
                      now: float, step: int | None = None
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """``query``'s rows and, with ``step`` (``HOUR`` or ``DAY``), ``series``'s
        buckets, from one read of the store: each bucket has its ``start`` (Unix
        seconds), the rows' counts and ``tokens`` (input + output, what ``tokens``
        budgets count). A day bucket starts at 00:00 UTC; the first may be partial."""
        if step is not None and step not in (HOUR, DAY):
            raise ValueError(f"step must be {HOUR} or {DAY} seconds")
        names = self.tables(since, now)
        found = await self.counters.counter_tables(names)
        rows: dict[tuple[str, ...], dict[str, Any]] = {}
        buckets: dict[int, dict[str, Any]] = {}
        if step is not None:  # every bucket of the span, empty ones too (a chart's x axis)
            for name in names:
                start = int(name[2:]) // step * step
                buckets.setdefault(start, {"start": start, **_zeros()})
        decoded: dict[str, tuple[tuple[str, str, str, str], str] | None] = {}
        for name, fields in found.items():
            bucket = buckets.get(int(name[2:]) // step * step) if step is not None else None
            for field, amount in fields.items():
                if field not in decoded:  # (the same fields repeat in every hour)
                    decoded[field] = _decode(field)
                parsed = decoded[field]
                if parsed is None:
                    continue
                key, kind = parsed
                if (sandbox is not None and key[1] != sandbox) or (
                        policy is not None and key[0] != policy):
                    continue
                row = rows.get(key)
                if row is None:
                    row = rows[key] = {**dict(zip(_KEY, key, strict=True)), **_zeros()}
                column = _KINDS[kind]
                row[column] += amount
                if bucket is not None:
                    bucket[column] += amount
        out = sorted(rows.values(), key=lambda r: tuple(r[k] for k in _KEY))
        for row in out:
            row["cost_usd"] = row["cost_usd"] / NANO
        series = [buckets[start] for start in sorted(buckets)]
        for bucket in series:
            bucket["cost_usd"] = bucket["cost_usd"] / NANO
            bucket["tokens"] = bucket["input_tokens"] + bucket["output_tokens"]
        return out, series


def _zeros() -> dict[str, Any]:
    return dict.fromkeys(_KINDS.values(), 0)


def _decode(field: str) -> tuple[tuple[str, str, str, str], str] | None:
    """A counter field's (policy, sandbox, credential, model) and kind code, or None
    for a field that is not the ledger's."""
    try:
        pol, sbx, cred, model, kind = json.loads(field)
    except (ValueError, TypeError):
        return None
    if kind not in _KINDS:
        return None
    return (str(pol), str(sbx), str(cred), str(model)), kind


def totals(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The sum of ``rows``' counts."""
    out: dict[str, Any] = dict.fromkeys(_KINDS.values(), 0)
    for row in rows:
        for column in _KINDS.values():
            out[column] += row[column]
    return out
