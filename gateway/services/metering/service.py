"""The metering step of the enforcement core: an inference call is metered or refused.

For a request the policy allowed on a rule with ``credential:``::

    step = metering.admit(sandbox=..., policy=..., rule=..., preset=..., method=...,
                          path=..., body=..., now=...)
    if not isinstance(step, Exchange):      # 403 model_not_allowed, metering_unavailable,
        refuse(step.status, step.code, ...)  # minted_secret_refused; 429 budget_exceeded
    else:
        forward(body=step.body if step.body is not None else original_body)
        step.head(response_header_fields)
        for chunk in response_body_chunks:  # decoded, as relayed
            step.feed(chunk)
        # a provider-minted secret (step.holds_response): the whole answer is held and
        #     body = metering.release(step, status, body, now)  # its secret -> an alias
        # a WebSocket session, each message from the sandbox before it is relayed:
        #     refusal = metering.session_message(step, data, now)
        # and each server event:  metering.session_event(step, data, now)
        metered = metering.complete(step, status, now, sent=...)  # status 0: no response
        audit["usage"] = metered.as_record()

**Fail closed.** On a rule that must be metered (its policy has a ``tokens`` or
``cost_usd`` budget for the credential, or the rule says ``metering: required``), a call
whose usage the gateway cannot guarantee to read is refused ``metering_unavailable``
with what to change: a body it could not hold or parse, a stream whose usage cannot be
asked for, inference it cannot read (images, audio, batches...). A call admitted under
a token or cost budget reserves its worst case (``estimate``) and settles to what it
used when it ends; one whose usage never arrives counts its reservation, not zero.

``admit``, ``complete`` and the session calls are synchronous, do no I/O and never wait
on a shared store; ``complete`` must be called once per admitted exchange, also when
the response failed.

The step's parts, a module each: ``exchange`` (what it hands out: ``Exchange``,
``Metered``), ``worst_case`` (a call's bound), ``refusing`` (its own refusals),
``settlement`` (holds settled, usage counted), ``sessions`` (WebSocket sessions),
``deferred`` (background jobs metered when retrieved), ``report`` (``GET /v1/usage``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.core.metering.endpoints import (
    Endpoint,
    RequestBody,
    classify,
    endpoint_text,
    not_inference,
    request_model,
    route,
    stream_usage,
)
from gateway.core.metering.models import ModelNames, check_model
from gateway.core.metering.pricing import Pricing, PricingError
from gateway.core.metering.refusals import BudgetExceeded, MeteringRefusal, StepRefusal
from gateway.core.metering.usage import JsonlMeter, Meter, SessionMeter, Usage, meter_for
from gateway.core.policy.compiled import Policy, PolicySet
from gateway.core.policy.model import Rule
from gateway.core.ports import SILENT, Telemetry
from gateway.services.metering import minted
from gateway.services.metering.budgets import BudgetBook, Hold, Reservation, budget_problems
from gateway.services.metering.catalogue import catalogue
from gateway.services.metering.deferred import DeferredJobs
from gateway.services.metering.exchange import NOT_METERED, Exchange, Metered
from gateway.services.metering.ledger import UsageLedger
from gateway.services.metering.pricing import load_pricing
from gateway.services.metering.refusing import Refusals
from gateway.services.metering.report import usage_report
from gateway.services.metering.sessions import Sessions
from gateway.services.metering.settlement import Settlement
from gateway.services.metering.worst_case import WorstCase
from gateway.services.secrets.ephemeral import EphemeralKeys
from gateway.services.state.counters import Counters, EmptyCounters
from gateway.services.state.health import unavailable_mode

if TYPE_CHECKING:
    from gateway.config import Config

__all__ = ["Exchange", "Metered", "Metering", "MeteringRefusal", "Refusal",
           "build_metering", "static_metering"]

Refusal = StepRefusal


class Metering:
    """Model allowlists, budgets and usage accounting over the state store's counters."""

    def __init__(self, counters: Counters, *, pricing: Pricing | None = None,
                 retention: float = 7 * 86400, stream_usage: bool = True,
                 ephemeral: EphemeralKeys | None = None, telemetry: Telemetry = SILENT,
                 share: bool = True) -> None:
        self.counters = counters
        # Where refusals and usage are counted: the gateway's metrics, or nowhere for a
        # step that decides without traffic (explain, policy test).
        self.telemetry = telemetry
        self.pricing = pricing
        self.stream_usage = stream_usage
        self.ephemeral = ephemeral if ephemeral is not None else EphemeralKeys()
        self.names = ModelNames()
        self.budgets = BudgetBook(counters, pricing, share=share)
        self.ledger = UsageLedger(counters, retention=retention)
        self.worst = WorstCase(pricing)
        self.refusals = Refusals(self.budgets, telemetry)
        self.settlement = Settlement(self.budgets, self.ledger, telemetry)
        self.sessions = Sessions(self.budgets, telemetry, self.refusals, self.worst,
                                 self.settlement)
        self.jobs = DeferredJobs(counters)

    # -- before forwarding -----------------------------------------------------------------

    def required(self, policy: Policy, rule: Rule) -> bool:
        """True if every inference call on ``rule`` must be metered (or refused)."""
        if rule.metering is not None and rule.metering.required:
            return True
        return rule.credential is not None and self.budgets.limits_usage(policy,
                                                                           rule.credential)

    def admit(self, *, sandbox: str, policy: Policy, rule: Rule, preset: str | None,
              method: str, path: str, body: bytes | None, now: float) -> Exchange | Refusal:
        """Before forwarding: the allowlist (403), what cannot be metered on a rule that
        must be (403), the budgets (429); then the request body to send and the meter for
        the response. ``body`` None: not held (streamed, or over the hold limit).
        Requests that are not inference calls (``GET /v1/models``...) pass unmetered."""
        credential = rule.credential
        if credential is None:  # only credential rules are metered
            return Exchange(sandbox, policy, "", None, None)
        held = RequestBody(body) if body is not None else None  # parsed once, if at all
        refused = check_model(rule, method, path, held)
        if refused is not None:
            self.telemetry.count("model_refusals", policy.name, credential)
            return refused
        endpoint = classify(method, path)
        required = (rule.metering is not None and rule.metering.required) or (
            bool(policy.budgets) and self.budgets.limits_usage(policy, credential))
        if endpoint is None:
            if required and not_inference(method, path) is None and \
                    not self._listed_unmetered(rule, path):
                return self.refusals.unavailable(policy, rule, (
                    f"{endpoint_text(method, path)} is no endpoint the gateway meters or "
                    "knows to be free of inference (a method, path or spelling it cannot "
                    f"model); if it is no inference call, list its path under unmetered: on "
                    f"rule {rule.source} to let it through unmetered"))
            return Exchange(sandbox, policy, credential, None, None, rule)
        kind = endpoint.kind
        if kind == "minted":
            if not rule.allow_minted_secrets:
                return self.refusals.refuse(policy, rule, "minted_secret_refused", (
                    f"this call has the provider mint a secret for the sandbox ({route(path)}"
                    "), which would work outside the gateway, its metering and allowlists; "
                    f"add allow_minted_secrets: true to rule {rule.source} to let it through "
                    "(the sandbox then receives an alias the gateway swaps back for the "
                    "secret on the credential's hosts only)"))
            return Exchange(sandbox, policy, credential, None, None, rule, endpoint,
                            holds_response=True)
        if kind == "unmetered":
            if required and not self._listed_unmetered(rule, path):
                return self.refusals.unavailable(policy, rule, f"{endpoint.what} ({route(path)}) "
                                         "answers without token usage the gateway can read "
                                         f"(list its path under unmetered: on rule "
                                         f"{rule.source} to let it through unmetered)")
            return Exchange(sandbox, policy, credential, None, None, rule, endpoint)
        data = held.json() if held is not None and held.raw else None
        if kind == "retrieval":
            key = self.jobs.retrieved(credential, endpoint, path, now)
            if key is None:  # not a job started here: not inference
                return Exchange(sandbox, policy, credential, None, None, rule, endpoint)
            return Exchange(sandbox, policy, credential, None, meter_for(
                None, method, path, None), rule, endpoint, retrieval=key)
        if data is not None and data.get("background") is True and kind == "inference" \
                and endpoint.format == "openai" and route(path).endswith("/responses"):
            kind, endpoint = "deferred", Endpoint(None, None, "deferred",
                                                  "a background response")
        if kind == "deferred":
            if required and not self._listed_unmetered(rule, path):
                return self.refusals.unavailable(policy, rule, f"{endpoint.what} ({route(path)}) "
                                         "is answered before its usage is known")
            job = "response" if endpoint.what == "a background response" else \
                "msgbatch" if endpoint.what.startswith("Anthropic") else "batch"
            return Exchange(sandbox, policy, credential, None, None, rule, endpoint,
                            deferred=job, capture=[])
        new_body: bytes | None = None
        if kind == "inference":
            if required and held is None:
                return self.refusals.unavailable(policy, rule, (
                    "the request body was not available to read (streamed without "
                    "Content-Length, or over the gateway's hold limit), so its usage "
                    "cannot be asked for or reserved; send a JSON body with Content-Length"))
            if required and data is None:
                return self.refusals.unavailable(policy, rule, (
                    "the request body is not one JSON object (or repeats a top-level key, "
                    'in any case: "model" and "Model"), so the gateway cannot read it as '
                    "the provider would; send one JSON object"))
            if (self.stream_usage or required) and data is not None and \
                    data.get("stream") is True:
                new_body, problem = stream_usage(preset, path, held, required=required)
                if problem is not None:
                    return self.refusals.unavailable(policy, rule, problem)
        hold: Hold | None = None
        if policy.budgets:
            reserve = Reservation()
            if kind == "inference" and self.budgets.limits_usage(policy, credential):
                found = self._reservation(policy, rule, endpoint, preset, path, held, data,
                                          new_body)
                if isinstance(found, str):
                    return self.refusals.unavailable(policy, rule, found)
                reserve = found
            if endpoint.format == "responses_ws":  # (counted per response.create)
                admitted: BudgetExceeded | MeteringRefusal | Hold | None = self.budgets.check(
                    sandbox, policy, credential, now, reserve=reserve)
            else:
                admitted = self.budgets.admit(sandbox, policy, credential, now, reserve)
            if isinstance(admitted, BudgetExceeded):
                self.telemetry.count("budget_refusals", policy.name, admitted.budget.name)
                return admitted
            if isinstance(admitted, MeteringRefusal):  # (the store is away: refuse mode)
                self.telemetry.count("metering_refusals", policy.name, admitted.code)
                return admitted
            hold = admitted
        assert endpoint.format is not None
        meter: Meter = (SessionMeter(endpoint.format, request_model(preset, path, held))
                        if kind == "session" else
                        Meter(endpoint.format, request_model(preset, path, held)))
        return Exchange(sandbox, policy, credential, new_body, meter, rule, endpoint, hold,
                        required)

    @staticmethod
    def _listed_unmetered(rule: Rule, path: str) -> bool:
        """True if the operator lets ``path`` through unmetered (the rule's
        ``unmetered:`` paths, read as the policy's ``paths`` are)."""
        return rule.unmetered_set is not None and rule.unmetered_set.matches(path)

    def _reservation(self, policy: Policy, rule: Rule, endpoint: Endpoint,
                     preset: str | None, path: str, held: RequestBody | None,
                     data: dict[str, Any] | None, sent: bytes | None) -> Reservation | str:
        """The call's bound as a reservation; ``sent``: the body the provider gets
        instead of the held one (the usage option added), which it bills."""
        raw = sent if sent is not None else held.raw if held is not None else b""
        model = request_model(preset, path, held)
        found = self.worst.bound(rule, endpoint, model, path, raw, data)
        if isinstance(found, str):
            return found
        assert rule.credential is not None
        return self.budgets.reservation(policy, rule.credential, model, *found)

    # -- while a WebSocket session is open (``sessions``) ------------------------------------

    def session_message(self, exchange: Exchange, data: bytes, now: float) -> Refusal | None:
        """A message from the sandbox in a metered WebSocket session, before it is
        relayed (``Sessions.session_message``)."""
        return self.sessions.session_message(exchange, data, now)

    def session_event(self, exchange: Exchange, data: bytes, now: float) -> None:
        """A server event of a metered WebSocket session, as relayed
        (``Sessions.session_event``)."""
        self.sessions.session_event(exchange, data, now)

    # -- after the response ----------------------------------------------------------------

    def release(self, exchange: Exchange, status: int, body: bytes, now: float) -> bytes | str:
        """A held answer (``holds_response``): each provider-minted secret in it is
        replaced by an alias the gateway keeps (bound to the credential's hosts and this
        sandbox, ``minted.release``); returns the answer, or why it cannot be relayed."""
        del now  # (the expiry is read on the ephemeral store's clock)
        return minted.release(self.ephemeral, credential=exchange.credential,
                              sandbox=exchange.sandbox, status=status, body=body)

    def complete(self, exchange: Exchange, status: int, now: float, *,
                 sent: bool = True) -> Metered:
        """After the response (or its failure, ``status`` 0; ``sent`` False: the request
        never reached the provider): count it everywhere."""
        if exchange.deferred is not None:
            self.jobs.started(exchange, status, now)
        meter = exchange.meter
        if meter is None:
            if exchange.hold is not None:
                self.budgets.settle(exchange.hold, 0, 0)
            return NOT_METERED
        usage = meter.finish(status)
        policy, credential = exchange.policy, exchange.credential
        if exchange.retrieval is not None:
            if not usage.known:
                return NOT_METERED  # (not done yet: metered when retrieved done)
            self.jobs.forget(exchange.retrieval, now)
        cost = self.budgets.cost(usage) if self.pricing is not None else None
        metered = Metered(usage, cost)
        if exchange.pending is not None:  # session calls that never ended
            for queue in exchange.pending.values():
                for pending in queue:
                    self.settlement.settle(exchange, pending.hold, Usage(), sent=sent,
                                           status=status)
            exchange.pending = None
        if exchange.hold is not None and isinstance(meter, SessionMeter):
            self.budgets.settle(exchange.hold, 0, 0)  # (its responses counted as they ended)
        elif exchange.hold is not None:
            metered = self.settlement.settle(exchange, exchange.hold, usage, sent=sent,
                                             status=status, cost=cost)
        elif exchange.retrieval is not None and policy.budgets:
            self.budgets.record(exchange.sandbox, policy, credential, usage, now)
        if isinstance(meter, JsonlMeter) and len(parts := meter.by_model()) > 1:
            for model_name, part in parts.items():  # (batch results: per model)
                part_cost = self.budgets.cost(part) if self.pricing is not None else None
                self.settlement.count(exchange, self.names(model_name), part, part_cost,
                                      status, now)
        else:
            self.settlement.count(exchange, self.names(usage.model), usage, cost, status, now)
        return metered

    # -- reports ---------------------------------------------------------------------------

    def problems(self, policy_set: PolicySet) -> list[str]:
        """Budgets this configuration cannot enforce (``cost_usd`` without prices)."""
        return budget_problems(list(policy_set.policies.values()), self.pricing)
    async def report(self, policy_set: PolicySet, *, sandbox: str | None,
                     policy: str | None, since: float | None, now: float,
                     by: str | None = None) -> dict[str, Any]:
        """The ``GET /v1/usage`` answer (``report.usage_report``)."""
        return await usage_report(self.ledger, self.budgets, self.counters, self.pricing,
                                  policy_set, sandbox=sandbox, policy=policy, since=since,
                                  now=now, by=by)


def build_metering(config: Config, counters: Counters,
                   ephemeral: EphemeralKeys | None = None,
                   telemetry: Telemetry = SILENT) -> Metering:
    """The Metering for a gateway config (raises ConfigError for a bad pricing file)."""
    from gateway.errors import ConfigError  # (the wiring's: the step itself reads no config)

    pricing = Pricing({}, "the model catalogue", catalogue())
    if config.metering.pricing is not None:
        try:
            pricing = load_pricing(config.metering.pricing, catalogue())
        except PricingError as exc:
            raise ConfigError(f"metering.pricing: {exc}") from None
    return Metering(counters, pricing=pricing, retention=config.metering.retention,
                    stream_usage=config.metering.stream_usage, ephemeral=ephemeral,
                    telemetry=telemetry,
                    share=unavailable_mode(config.state) == "serve")


def static_metering(pricing: Pricing | None = None) -> Metering:
    """A metering step over counters that stay empty: its answers depend on the request
    alone, however many it gives (nothing is used, nothing recorded), and its refusals
    are not counted in the gateway's metrics (an explain is not traffic). ``pricing``:
    the gateway's, for cost budgets. What ``policy explain``, ``policy test``, replay
    and the console give ``core/evaluate`` as its ``Metering`` port."""
    return Metering(EmptyCounters(), pricing=pricing, stream_usage=True)
