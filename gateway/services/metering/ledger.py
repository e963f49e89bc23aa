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

from gateway.services.metering.usage import Usage
from gateway.services.state.counters import Counters

__all__ = ["HOUR", "UsageLedger"]

HOUR = 3600
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
        found = await self.counters.counter_tables(self.tables(since, now))
        rows: dict[tuple[str, ...], dict[str, Any]] = {}
        for fields in found.values():
            for field, amount in fields.items():
                try:
                    pol, sbx, cred, model, kind = json.loads(field)
                except (ValueError, TypeError):
                    continue
                if kind not in _KINDS or (sandbox is not None and sbx != sandbox) or (
                        policy is not None and pol != policy):
                    continue
                key = (str(pol), str(sbx), str(cred), str(model))
                row = rows.get(key)
                if row is None:
                    row = rows[key] = dict(zip(_KEY, key, strict=True))
                    row.update(dict.fromkeys(_KINDS.values(), 0))
                row[_KINDS[kind]] += amount
        out = sorted(rows.values(), key=lambda r: tuple(r[k] for k in _KEY))
        for row in out:
            row["cost_usd"] = row["cost_usd"] / NANO
        return out


def totals(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The sum of ``rows``' counts."""
    out: dict[str, Any] = dict.fromkeys(_KINDS.values(), 0)
    for row in rows:
        for column in _KINDS.values():
            out[column] += row[column]
    return out
