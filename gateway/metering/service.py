"""The metering step of the enforcement core: one object, two calls per exchange.

For a request the policy allowed on a rule with ``credential:``::

    step = metering.admit(sandbox=..., policy=..., rule=..., preset=..., method=...,
                          path=..., body=..., now=...)
    if not isinstance(step, Exchange):      # ModelRefusal (403) or BudgetExceeded (429)
        refuse(step.status, step.code, step.reason, rule=step.rule,
               retry_after=step.retry_after)
    else:
        forward(body=step.body if step.body is not None else original_body)
        for chunk in response_body_chunks:  # decoded, as relayed
            step.feed(chunk)                # (a Realtime session: each server event)
        # a Realtime session, before relaying each message from the sandbox:
        #     exceeded = metering.check_open(step, now)   # 429 once its budget is used up
        metered = metering.complete(step, status, now)   # status 0: no response
        audit["usage"] = metered.as_record()

``admit`` and ``complete`` are synchronous, do no I/O and never wait on a shared store;
``complete`` must be called once per admitted exchange, also when the response failed.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from gateway import metrics
from gateway.config import Config, ConfigError
from gateway.counters import Counters
from gateway.metering.budgets import BudgetBook, BudgetExceeded, budget_problems
from gateway.metering.endpoints import RequestBody, rewrite_request_body
from gateway.metering.ledger import UsageLedger, totals
from gateway.metering.models import ModelNames, ModelRefusal, check_model
from gateway.metering.pricing import Pricing, PricingError, load_pricing
from gateway.metering.usage import Meter, RealtimeMeter, Usage, meter_for
from gateway.policy.model import Policy, PolicySet, Rule

__all__ = ["Exchange", "Metered", "Metering", "Refusal", "build_metering"]

Refusal = ModelRefusal | BudgetExceeded


@dataclass(slots=True)
class Exchange:
    """An admitted exchange: ``body`` is the request body to forward instead of the
    original (None = unchanged; update Content-Length), ``feed`` takes response chunks."""

    sandbox: str
    policy: Policy
    credential: str
    body: bytes | None
    meter: Meter | None

    def feed(self, chunk: bytes) -> None:
        """One decoded response body chunk, as relayed."""
        if self.meter is not None:
            self.meter.feed(chunk)


@dataclass(frozen=True, slots=True)
class Metered:
    """What an exchange used (``usage`` None: not an inference call) and its cost."""

    usage: Usage | None
    cost_usd: float | None

    def as_record(self) -> dict[str, Any] | None:
        """The audit line's ``usage`` object (None for a non-inference request)."""
        if self.usage is None:
            return None
        record = self.usage.as_record()
        record["cost_usd"] = self.cost_usd
        return record


_NOT_METERED = Metered(None, None)


def _status_label(status: int) -> str:
    return str(status) if 100 <= status <= 599 else "error"


class Metering:
    """Model allowlists, budgets and usage accounting over the state store's counters."""

    def __init__(self, counters: Counters, *, pricing: Pricing | None = None,
                 retention: float = 7 * 86400, stream_usage: bool = True) -> None:
        self.counters = counters
        self.pricing = pricing
        self.stream_usage = stream_usage
        self.names = ModelNames()
        self.budgets = BudgetBook(counters, pricing)
        self.ledger = UsageLedger(counters, retention=retention)
        # (policy, credential, model) -> the input, output and cached token counters
        self._token_metrics: dict[tuple[str, str, str], tuple[Counter, ...]] = {}

    def admit(self, *, sandbox: str, policy: Policy, rule: Rule, preset: str | None,
              method: str, path: str, body: bytes | None, now: float) -> Exchange | Refusal:
        """Before forwarding: the allowlist (403), then, for inference calls, the
        budgets (429); then the request body to send and the meter for the response.
        Requests that are not inference calls (``GET /v1/models``...) are neither
        limited nor counted by budgets."""
        credential = rule.credential
        if credential is None:  # only credential rules are metered
            return Exchange(sandbox, policy, "", None, None)
        held = RequestBody(body) if body is not None else None  # parsed once, if at all
        refused = check_model(rule, method, path, held)
        if refused is not None:
            metrics.child(metrics.MODEL_REFUSALS, policy.name, credential).inc()
            return refused
        meter = meter_for(preset, method, path, held)
        if meter is None:
            return Exchange(sandbox, policy, credential, None, None)
        if policy.budgets:
            exceeded = self.budgets.check(sandbox, policy, credential, now)
            if exceeded is not None:
                metrics.child(metrics.BUDGET_REFUSALS, policy.name, exceeded.budget.name).inc()
                return exceeded
            self.budgets.admitted(sandbox, policy, credential, now)
        new_body = rewrite_request_body(preset, path, held) if self.stream_usage else None
        return Exchange(sandbox, policy, credential, new_body, meter)

    def check_open(self, exchange: Exchange, now: float) -> BudgetExceeded | None:
        """While a session is open (a Realtime WebSocket), before relaying the sandbox's
        next message: a budget its responses so far have used up (with what was recorded
        before) refuses it; a session is not metered as it goes, only when it ends."""
        meter = exchange.meter
        if not isinstance(meter, RealtimeMeter) or not exchange.policy.budgets:
            return None
        exceeded = self.budgets.check(exchange.sandbox, exchange.policy, exchange.credential,
                                      now, open_session=meter.so_far())
        if exceeded is not None:
            metrics.child(metrics.BUDGET_REFUSALS, exchange.policy.name,
                          exceeded.budget.name).inc()
        return exceeded

    def complete(self, exchange: Exchange, status: int, now: float) -> Metered:
        """After the response (or its failure, ``status`` 0): count it everywhere."""
        meter = exchange.meter
        if meter is None:
            return _NOT_METERED
        usage = meter.finish(status)
        policy, credential = exchange.policy, exchange.credential
        cost = self.budgets.cost(usage) if self.pricing is not None else None
        if policy.budgets:
            self.budgets.record(exchange.sandbox, policy, credential, usage, now)
        model = self.names(usage.model)
        self.ledger.record(exchange.sandbox, policy.name, credential, model, usage, cost, now)
        key = (policy.name, credential, model)
        tokens = self._token_metrics.get(key)
        if tokens is None:
            if len(self._token_metrics) >= 4096:
                self._token_metrics.clear()
            tokens = self._token_metrics[key] = tuple(
                metrics.child(metrics.INFERENCE_TOKENS, *key, kind)
                for kind in ("input", "output", "cached"))
        metrics.child(metrics.INFERENCE_REQUESTS, *key, _status_label(status)).inc()
        for counter, value in zip(tokens, (usage.input_tokens, usage.output_tokens,
                                           usage.cached_input_tokens), strict=True):
            if value:
                counter.inc(value)
        return Metered(usage, cost)

    def problems(self, policy_set: PolicySet) -> list[str]:
        """Budgets this configuration cannot enforce (``cost_usd`` without prices)."""
        return budget_problems(list(policy_set.policies.values()), self.pricing)

    async def report(self, policy_set: PolicySet, *, sandbox: str | None,
                     policy: str | None, since: float | None, now: float) -> dict[str, Any]:
        """The ``GET /v1/usage`` answer: rows, totals, budget status, degraded flag."""
        start = (math.floor(since / 3600) * 3600 if since is not None
                 else math.floor((now - self.ledger.retention) / 3600) * 3600)
        rows = await self.ledger.query(sandbox=sandbox, policy=policy, since=start, now=now)
        if self.pricing is None:
            for row in rows:
                row["cost_usd"] = None
        names = [policy] if policy is not None else sorted({r["policy"] for r in rows})
        budgets: list[dict[str, Any]] = []
        for name in names:
            found = policy_set.get(name)
            if found is not None:
                budgets.extend(await self.budgets.status(found, sandbox, now))
        summed = totals([{**r, "cost_usd": r["cost_usd"] or 0} for r in rows])
        if self.pricing is None:
            summed["cost_usd"] = None
        return {
            "since": _iso(start), "until": _iso(now), "sandbox": sandbox, "policy": policy,
            "degraded": self.counters.counters_degraded,
            "totals": summed, "rows": rows, "budgets": budgets,
        }


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_metering(config: Config, counters: Counters) -> Metering:
    """The Metering for a gateway config (raises ConfigError for a bad pricing file)."""
    pricing = None
    if config.metering.pricing is not None:
        try:
            pricing = load_pricing(config.metering.pricing)
        except PricingError as exc:
            raise ConfigError(f"metering.pricing: {exc}") from None
    return Metering(counters, pricing=pricing, retention=config.metering.retention,
                    stream_usage=config.metering.stream_usage)
