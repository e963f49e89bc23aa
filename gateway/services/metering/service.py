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
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.core.metering.endpoints import (
    Endpoint,
    RequestBody,
    body_json,
    classify,
    endpoint_text,
    field_of,
    not_inference,
    request_model,
    route,
    stream_usage,
)
from gateway.core.metering.estimate import (
    Unreadable,
    choices,
    input_bound,
    output_bound,
)
from gateway.core.metering.jsondoc import document
from gateway.core.metering.models import (
    ModelNames,
    check_event_models,
    check_model,
)
from gateway.core.metering.pricing import Pricing, PricingError
from gateway.core.metering.refusals import BudgetExceeded, MeteringRefusal, StepRefusal
from gateway.core.metering.settling import Bound, ending
from gateway.core.metering.usage import (
    RESPONSE_HOLD,
    JsonlMeter,
    Meter,
    SessionMeter,
    Usage,
    meter_for,
)
from gateway.core.policy.compiled import Policy, PolicySet
from gateway.core.policy.model import Rule
from gateway.core.ports import SILENT, Telemetry
from gateway.services.metering import minted
from gateway.services.metering.budgets import (
    NANO,
    BudgetBook,
    Hold,
    Reservation,
    budget_problems,
)
from gateway.services.metering.catalogue import catalogue
from gateway.services.metering.ledger import DAY, HOUR, UsageLedger, totals
from gateway.services.metering.pricing import load_pricing
from gateway.services.secrets.ephemeral import EphemeralKeys
from gateway.services.state.counters import Counters, EmptyCounters

if TYPE_CHECKING:
    from gateway.config import Config

__all__ = ["Exchange", "Metered", "Metering", "MeteringRefusal", "Refusal",
           "build_metering"]

log = logging.getLogger("sandbox_gateway.metering")

_DEFERRED_DAYS = 8  # a deferred job's usage is metered if retrieved within this many days


Refusal = StepRefusal


@dataclass(slots=True)
class _Pending:
    """A ``response.create`` of a Responses WebSocket session that holds a reservation."""

    hold: Hold
    started: bool = False
    event_id: str | None = None  # the client's event_id (a Realtime error names it)
    response_id: str | None = None  # the provider's, from its response.created


@dataclass(slots=True)
class Exchange:
    """An admitted exchange: ``body`` is the request body to forward instead of the
    original (None = unchanged; update Content-Length), ``feed`` takes response chunks."""

    sandbox: str
    policy: Policy
    credential: str
    body: bytes | None
    meter: Meter | None
    rule: Rule | None = None
    endpoint: Endpoint | None = None
    hold: Hold | None = None
    required: bool = False
    deferred: str | None = None  # the kind of job whose id the answer names
    retrieval: str | None = None  # the pending job whose usage this answer may carry
    holds_response: bool = False  # a provider-minted secret: read before it is relayed
    capture: list[bytes] | None = None
    pending: dict[str | None, list[_Pending]] | None = None  # (a Responses session's)

    def head(self, header: Callable[[str], str | None]) -> None:
        """The response's headers (``header(name)``: a field's value, or None)."""
        if self.meter is not None:
            self.meter.head(header)

    def feed(self, chunk: bytes) -> None:
        """One decoded response body chunk, as relayed."""
        if self.meter is not None:
            self.meter.feed(chunk)
        if self.capture is not None and sum(map(len, self.capture)) < RESPONSE_HOLD:
            self.capture.append(bytes(chunk))


@dataclass(frozen=True, slots=True)
class Metered:
    """What an exchange used (``usage`` None: not an inference call), its cost, and
    what budgets counted: ``reserved`` while it ran, ``charged`` (tokens) when it ended,
    on ``basis`` "usage" or "reservation" (its usage never arrived)."""

    usage: Usage | None
    cost_usd: float | None
    reserved: int | None = None
    charged: int | None = None
    basis: str | None = None

    def as_record(self) -> dict[str, Any] | None:
        """The audit line's ``usage`` object (None for a non-inference request)."""
        if self.usage is None:
            return None
        record = self.usage.as_record()
        record["cost_usd"] = self.cost_usd
        if self.reserved is not None:
            record["budget"] = {"reserved_tokens": self.reserved,
                                "charged_tokens": self.charged, "basis": self.basis}
        return record


_NOT_METERED = Metered(None, None)


def _status_label(status: int) -> str:
    return str(status) if 100 <= status <= 599 else "error"


class Metering:
    """Model allowlists, budgets and usage accounting over the state store's counters."""

    def __init__(self, counters: Counters, *, pricing: Pricing | None = None,
                 retention: float = 7 * 86400, stream_usage: bool = True,
                 ephemeral: EphemeralKeys | None = None, telemetry: Telemetry = SILENT) -> None:
        self.counters = counters
        # Where refusals and usage are counted: the gateway's metrics, or nowhere for a
        # step that decides without traffic (explain, policy test).
        self.telemetry = telemetry
        self.pricing = pricing
        self._limits: Pricing | None = None
        self.stream_usage = stream_usage
        self.ephemeral = ephemeral if ephemeral is not None else EphemeralKeys()
        self.names = ModelNames()
        self.budgets = BudgetBook(counters, pricing)
        self.ledger = UsageLedger(counters, retention=retention)
        # (policy, credential, model) -> the input, output and cached token counters
        self._unread_logged: set[tuple[str, str]] = set()

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
                return self._unavailable(policy, rule, (
                    f"{endpoint_text(method, path)} is no endpoint the gateway meters or "
                    "knows to be free of inference (a method, path or spelling it cannot "
                    f"model); if it is no inference call, list its path under unmetered: on "
                    f"rule {rule.source} to let it through unmetered"))
            return Exchange(sandbox, policy, credential, None, None, rule)
        kind = endpoint.kind
        if kind == "minted":
            if not rule.allow_minted_secrets:
                return self._refuse(policy, rule, "minted_secret_refused", (
                    f"this call has the provider mint a secret for the sandbox ({route(path)}"
                    "), which would work outside the gateway, its metering and allowlists; "
                    f"add allow_minted_secrets: true to rule {rule.source} to let it through "
                    "(the sandbox then receives an alias the gateway swaps back for the "
                    "secret on the credential's hosts only)"))
            return Exchange(sandbox, policy, credential, None, None, rule, endpoint,
                            holds_response=True)
        if kind == "unmetered":
            if required and not self._listed_unmetered(rule, path):
                return self._unavailable(policy, rule, f"{endpoint.what} ({route(path)}) "
                                         "answers without token usage the gateway can read "
                                         f"(list its path under unmetered: on rule "
                                         f"{rule.source} to let it through unmetered)")
            return Exchange(sandbox, policy, credential, None, None, rule, endpoint)
        data = held.json() if held is not None and held.raw else None
        if kind == "retrieval":
            key = self._retrieved(credential, endpoint, path, now)
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
                return self._unavailable(policy, rule, f"{endpoint.what} ({route(path)}) "
                                         "is answered before its usage is known")
            job = "response" if endpoint.what == "a background response" else \
                "msgbatch" if endpoint.what.startswith("Anthropic") else "batch"
            return Exchange(sandbox, policy, credential, None, None, rule, endpoint,
                            deferred=job, capture=[])
        new_body: bytes | None = None
        if kind == "inference":
            if required and held is None:
                return self._unavailable(policy, rule, (
                    "the request body was not available to read (streamed without "
                    "Content-Length, or over the gateway's hold limit), so its usage "
                    "cannot be asked for or reserved; send a JSON body with Content-Length"))
            if required and data is None:
                return self._unavailable(policy, rule, (
                    "the request body is not one JSON object (or repeats a top-level key, "
                    'in any case: "model" and "Model"), so the gateway cannot read it as '
                    "the provider would; send one JSON object"))
            if (self.stream_usage or required) and data is not None and \
                    data.get("stream") is True:
                new_body, problem = stream_usage(preset, path, held, required=required)
                if problem is not None:
                    return self._unavailable(policy, rule, problem)
        hold: Hold | None = None
        if policy.budgets:
            reserve = Reservation()
            if kind == "inference" and self.budgets.limits_usage(policy, credential):
                found = self._reservation(policy, rule, endpoint, preset, path, held, data,
                                          new_body)
                if isinstance(found, str):
                    return self._unavailable(policy, rule, found)
                reserve = found
            if endpoint.format == "responses_ws":  # (counted per response.create)
                admitted: BudgetExceeded | Hold | None = self.budgets.check(
                    sandbox, policy, credential, now, reserve=reserve)
            else:
                admitted = self.budgets.admit(sandbox, policy, credential, now, reserve)
            if isinstance(admitted, BudgetExceeded):
                self.telemetry.count("budget_refusals", policy.name, admitted.budget.name)
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

    @property
    def limits(self) -> Pricing:
        """Where models' context windows and output limits are read: the operator's
        pricing file over the catalogue (loaded at the first call that needs it)."""
        if self._limits is None:
            self._limits = self.pricing if self.pricing is not None and \
                self.pricing.fallback is not None else Pricing(
                    self.pricing.entries if self.pricing is not None else {},
                    self.pricing.source if self.pricing is not None else "<none>",
                    catalogue())
        return self._limits

    def bound(self, rule: Rule, endpoint: Endpoint, model: str | None, path: str,
              raw: bytes, data: dict[str, Any] | None) -> tuple[int, int] | str:
        """The most ``(input, output)`` tokens a call may be billed (``estimate``), or
        why it has no bound: what to change."""
        limits = self.limits.limits(model)
        metering = rule.metering
        context = limits.context if limits is not None and limits.context else (
            metering.max_input_tokens if metering is not None else None)
        where = self.limits.fallback.source if self.limits.fallback else "the catalogue"
        known = (f'model "{(model or "unknown")[:100]}"' +
                 (f" ({limits.source})" if limits is not None else f" (not in {where})"))
        try:
            out = output_bound(endpoint, data, path, limits.max_output if limits else None)
            fed = input_bound(raw, data, context)
        except Unreadable as exc:
            return (f"{exc}, so the call's worst case cannot be read; send it as a whole "
                    "number")
        if out is None:
            reserve = metering.reserve if metering is not None else None
            if reserve is None:
                return (f"the call names no output limit and the maximum output of {known} "
                        f"is unknown; send max_tokens (or max_output_tokens), or set "
                        f"metering.reserve on rule {rule.source}, or max_output_tokens for "
                        "the model in metering.pricing")
            out = reserve * choices(data)
        if fed.tokens is None:
            return (f"{fed.why}, and the context window of {known} is unknown, so its "
                    f"input has no bound; set metering.max_input_tokens on rule "
                    f"{rule.source}, or context_window for the model in metering.pricing")
        return fed.tokens, out

    def _reservation(self, policy: Policy, rule: Rule, endpoint: Endpoint,
                     preset: str | None, path: str, held: RequestBody | None,
                     data: dict[str, Any] | None, sent: bytes | None) -> Reservation | str:
        """The call's bound as a reservation; ``sent``: the body the provider gets
        instead of the held one (the usage option added), which it bills."""
        raw = sent if sent is not None else held.raw if held is not None else b""
        model = request_model(preset, path, held)
        found = self.bound(rule, endpoint, model, path, raw, data)
        if isinstance(found, str):
            return found
        assert rule.credential is not None
        return self.budgets.reservation(policy, rule.credential, model, *found)

    def _refuse(self, policy: Policy, rule: Rule, code: str, reason: str) -> MeteringRefusal:
        self.telemetry.count("metering_refusals", policy.name, code)
        return MeteringRefusal(code, reason, rule.source)

    def _unavailable(self, policy: Policy, rule: Rule, why: str) -> MeteringRefusal:
        budgeted = rule.credential is not None and self.budgets.limits_usage(
            policy, rule.credential)
        because = (f"policy {policy.name!r} has a token or cost budget for credential "
                   f"{rule.credential!r}" if budgeted else
                   f"rule {rule.source} sets metering: required")
        return self._refuse(policy, rule, "metering_unavailable",
                            f"this call cannot be metered: {why}; every inference call "
                            f"must be metered here because {because}")

    # -- while a WebSocket session is open -------------------------------------------------

    def session_message(self, exchange: Exchange, data: bytes, now: float) -> Refusal | None:
        """A message from the sandbox in a metered WebSocket session, before it is
        relayed: models it names must be allowed (``session.update``,
        ``response.create``); a used-up budget refuses it; each ``response.create``, in
        or out of band, is a call that reserves its bound before it is relayed (refused
        when the budget has no room for it) and settles on the response's end. A
        Codex warm-up (``generate: false``) is no request: it reserves only its input.
        A Realtime session that may start responses on its own (turn detection) cannot
        be reserved for: its audio is refused on a budgeted rule until the provider says
        automatic responses are off."""
        meter, rule = exchange.meter, exchange.rule
        if not isinstance(meter, SessionMeter) or rule is None:
            return None
        policy = exchange.policy
        if rule.models is None and not policy.budgets and not exchange.required:
            return None
        fields = body_json(data)
        if fields is None:
            return self._unavailable(policy, rule, (
                "a session message that is not one JSON object (or repeats a top-level key) "
                "cannot be checked; send each event as one JSON object"))
        kind = fields.get("type")
        refused = check_event_models(rule, fields, kind, meter.format)
        if refused is not None:
            self.telemetry.count("model_refusals", policy.name, exchange.credential)
            return refused
        if not policy.budgets or not self.budgets.limits_usage(policy, exchange.credential):
            if policy.budgets and kind == "response.create" and meter.format == "realtime":
                return self._session_request(exchange, now)
            return None
        if kind == "response.create":
            return self._reserve_response(exchange, rule, fields, data, now)
        if meter.format == "responses_ws" and kind != "response.cancel":
            return self._unavailable(policy, rule, (
                f"a {str(kind)[:40]!r} message is none the gateway can meter on a Responses "
                "API session (only response.create and response.cancel)"))
        if meter.format == "realtime" and meter.auto_responses and kind in (
                "input_audio_buffer.append", "input_audio_buffer.commit"):
            return self._unavailable(policy, rule, (
                "this Realtime session may start responses on its own (turn detection with "
                "create_response), which cannot be reserved against the budget before they "
                "start; send session.update with turn_detection.create_response: false (or "
                "turn_detection: null) and a response.create for each response"))
        exceeded = self.budgets.check(exchange.sandbox, policy, exchange.credential, now,
                                      open_session=Usage())
        if exceeded is not None:
            self.telemetry.count("budget_refusals", policy.name, exceeded.budget.name)
        return exceeded

    def _session_request(self, exchange: Exchange, now: float) -> Refusal | None:
        """A Realtime ``response.create`` on a rule with a requests budget only: one
        more request (no tokens to reserve)."""
        admitted = self.budgets.admit(exchange.sandbox, exchange.policy, exchange.credential,
                                      now, Reservation())
        if isinstance(admitted, BudgetExceeded):
            self.telemetry.count("budget_refusals", exchange.policy.name,
                                 admitted.budget.name)
            return admitted
        if admitted is not None:
            self.budgets.settle(admitted, 0, 0)
        return None

    def _reserve_response(self, exchange: Exchange, rule: Rule, fields: dict[str, Any],
                          data: bytes, now: float) -> Refusal | None:
        """Reserve the bound of one ``response.create`` (see ``session_message``)."""
        meter = exchange.meter
        assert isinstance(meter, SessionMeter)
        policy = exchange.policy
        response = field_of(fields, "response")
        model = (_string(fields.get("model")) or _string(field_of(response, "model"))
                 or meter.model or meter.request_model)
        request = Endpoint(meter.format, None)
        # The response's own settings (Realtime puts them in "response") over the event's.
        own = dict(response) if isinstance(response, list) else {}
        own.update({k: v for k, v in fields.items() if k != "response"})
        warm_up = fields.get("generate") is False or own.get("generate") is False
        # A session's response reads the conversation the provider keeps: its input is
        # bounded by the context window, whatever the event carries.
        found = self.bound(rule, request, model, "", data,
                           {**own, "previous_response_id": "(the session's state)"}
                           if meter.format == "realtime" or own.get("previous_response_id")
                           else own)
        if isinstance(found, str):
            return self._unavailable(policy, rule, found)
        input_tokens, output_tokens = found
        reserve = self.budgets.reservation(policy, exchange.credential, model, input_tokens,
                                           0 if warm_up else output_tokens)
        if isinstance(reserve, str):
            return self._unavailable(policy, rule, reserve)
        admitted = self.budgets.admit(exchange.sandbox, policy, exchange.credential, now,
                                      reserve, requests=0 if warm_up else 1)
        if isinstance(admitted, BudgetExceeded):
            self.telemetry.count("budget_refusals", policy.name, admitted.budget.name)
            return admitted
        if isinstance(admitted, Hold):
            lane = _string(fields.get("stream_id"))
            if exchange.pending is None:
                exchange.pending = {}
            exchange.pending.setdefault(lane, []).append(
                _Pending(hold=admitted, event_id=_string(fields.get("event_id"))))
        return None

    def session_event(self, exchange: Exchange, data: bytes, now: float) -> None:
        """A server event of a metered WebSocket session, as relayed: a response that
        ends is counted against budgets at once (settling its reservation)."""
        meter = exchange.meter
        if not isinstance(meter, SessionMeter):
            if meter is not None:
                meter.feed(data)
            return
        usage = meter.event(data)
        policy = exchange.policy
        if not policy.budgets:
            return
        if usage is None and b'"response.created"' not in data and b'"error"' not in data:
            return
        lane = _lane(data)
        queue = exchange.pending.get(lane) if exchange.pending is not None else None
        if not queue:
            if usage is not None and usage.known:
                self.budgets.record(exchange.sandbox, policy, exchange.credential, usage, now)
            return
        if usage is None:
            doc = _event(data)
            kind = doc.get("type") if doc is not None else None
            waiting = next((p for p in queue if not p.started), None)
            if waiting is None:
                return
            if kind == "response.created" and doc is not None:
                waiting.started = True  # (responses are created in the order asked for)
                waiting.response_id = _string(field_of(doc.get("response"), "id"))
            elif kind == "error" and doc is not None:  # a response.create refused unbegun
                if meter.format == "realtime":  # (its error names the client's event)
                    named = _string(field_of(doc.get("error"), "event_id"))
                    waiting = next((p for p in queue if not p.started and p.event_id
                                    and p.event_id == named), None)
                    if waiting is None:
                        return
                elif any(p.started for p in queue):
                    return  # (it may be a running response's: which one, none can say)
                else:  # (one of the queued ones, unbegun: release the smallest bound)
                    waiting = queue[ending(_bounds(queue), (0, 0), None).index]
                queue.remove(waiting)
                self.budgets.settle(waiting.hold, 0, 0)
            return
        self._settle_ended(exchange, queue, usage, meter.last_id)

    def _settle_ended(self, exchange: Exchange, queue: list[_Pending], usage: Usage,
                      response_id: str | None) -> None:
        """A response of the session ended with ``usage``: settle the reservation
        ``core.metering.settling`` picks (not the one its id names: ids are tied to
        reservations by an order the provider need not keep)."""
        used: tuple[int, int] | None = None
        if usage.known:
            cost = (self.budgets.cost(usage)
                    if any(b.cost_usd is not None for b in exchange.policy.budgets) else None)
            used = (usage.tokens, round((cost or 0.0) * NANO))
        chosen = ending(_bounds(queue), used, response_id)
        pending = queue.pop(chosen.index)
        if chosen.tokens is None or chosen.nano_usd is None:
            self._settle(exchange, pending.hold, usage, sent=True, status=200)
            return
        self._unread(exchange)  # (charged the largest bound of the session)
        self.budgets.settle(pending.hold, chosen.tokens, chosen.nano_usd)

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
            self._deferred(exchange, status, now)
        meter = exchange.meter
        if meter is None:
            if exchange.hold is not None:
                self.budgets.settle(exchange.hold, 0, 0)
            return _NOT_METERED
        usage = meter.finish(status)
        policy, credential = exchange.policy, exchange.credential
        if exchange.retrieval is not None:
            if not usage.known:
                return _NOT_METERED  # (not done yet: metered when retrieved done)
            self._forget(exchange.retrieval, now)
        cost = self.budgets.cost(usage) if self.pricing is not None else None
        metered = Metered(usage, cost)
        if exchange.pending is not None:  # session calls that never ended
            for queue in exchange.pending.values():
                for pending in queue:
                    self._settle(exchange, pending.hold, Usage(), sent=sent, status=status)
            exchange.pending = None
        if exchange.hold is not None and isinstance(meter, SessionMeter):
            self.budgets.settle(exchange.hold, 0, 0)  # (its responses counted as they ended)
        elif exchange.hold is not None:
            metered = self._settle(exchange, exchange.hold, usage, sent=sent, status=status,
                                   cost=cost)
        elif exchange.retrieval is not None and policy.budgets:
            self.budgets.record(exchange.sandbox, policy, credential, usage, now)
        if isinstance(meter, JsonlMeter) and len(parts := meter.by_model()) > 1:
            for model_name, part in parts.items():  # (batch results: per model)
                part_cost = self.budgets.cost(part) if self.pricing is not None else None
                self._count(exchange, self.names(model_name), part, part_cost, status, now)
        else:
            self._count(exchange, self.names(usage.model), usage, cost, status, now)
        return metered

    def _settle(self, exchange: Exchange, hold: Hold, usage: Usage, *, sent: bool,
                status: int, cost: float | None = None) -> Metered:
        """Settle ``hold`` to what the call used: its usage, else (a call that reached the
        provider and got a success or no answer at all) its reservation."""
        reserved = hold.reserved
        basis = "usage"
        if usage.known:
            if cost is None and any(b.cost_usd is not None for b in exchange.policy.budgets):
                cost = self.budgets.cost(usage)
            tokens, nano = usage.tokens, round((cost or 0.0) * NANO)
        elif sent and (status in (0, 101) or 200 <= status < 300):  # (101: a session)
            tokens, nano, basis = reserved.tokens, reserved.nano_usd, "reservation"
            self._unread(exchange)
        else:
            tokens = nano = 0  # the provider refused it (4xx/5xx): nothing was used
        self.budgets.settle(hold, tokens, nano)
        return Metered(usage, cost, reserved.tokens, tokens, basis)

    def _unread(self, exchange: Exchange) -> None:
        key = (exchange.policy.name, exchange.credential)
        self.telemetry.count("reservations_charged", *key)
        if key not in self._unread_logged and len(self._unread_logged) < 1000:
            self._unread_logged.add(key)
            log.warning("metering: a call on credential %r (policy %r) ended without usage "
                        "the gateway could read; budgets count its reservation (logged once)",
                        exchange.credential, exchange.policy.name)

    def _count(self, exchange: Exchange, model: str, usage: Usage, cost: float | None,
               status: int, now: float) -> None:
        policy, credential = exchange.policy, exchange.credential
        self.ledger.record(exchange.sandbox, policy.name, credential, model, usage, cost, now)
        key = (policy.name, credential, model)
        self.telemetry.count("inference_requests", *key, _status_label(status))
        for kind, value in (("input", usage.input_tokens), ("output", usage.output_tokens),
                            ("cached", usage.cached_input_tokens)):
            if value:
                self.telemetry.count("inference_tokens", *key, kind, by=value)

    # -- deferred jobs (background responses, batches) --------------------------------------

    @staticmethod
    def _job_key(credential: str, job: str, job_id: str) -> str:
        return f"{credential}:{job}:{job_id}"

    def _deferred(self, exchange: Exchange, status: int, now: float) -> None:
        """A deferred job was started: remember its id, so that retrieving its result
        through the gateway meters it (once)."""
        parts, exchange.capture = exchange.capture or [], None
        if not 200 <= status < 300 or exchange.deferred is None:
            return
        try:
            doc = document(b"".join(parts), _JSON)
        except ValueError:
            return
        job_id = doc.get("id") if isinstance(doc, dict) else None
        if not isinstance(job_id, str) or not 0 < len(job_id) <= 200:
            return
        day = math.floor(now / 86400)
        self.counters.count([(f"jobs:{day}", self._job_key(exchange.credential,
                                                           exchange.deferred, job_id), 1,
                              (day + _DEFERRED_DAYS + 1) * 86400.0)])

    def _retrieved(self, credential: str, endpoint: Endpoint, path: str,
                   now: float) -> str | None:
        """The key of the job a retrieval reads, if it was started here and not yet
        metered."""
        parts = route(path).split("/")
        if endpoint.format == "jsonl":  # /v1/messages/batches/{id}/results
            job, job_id = "msgbatch", parts[-2]
        elif "/batches/" in route(path):
            job, job_id = "batch", parts[-1]
        else:
            job, job_id = "response", parts[-1]
        key = self._job_key(credential, job, job_id)
        day = math.floor(now / 86400)
        for back in range(_DEFERRED_DAYS + 1):
            if self.counters.counter(f"jobs:{day - back}", key) > 0:
                return key
        return None

    def _forget(self, key: str, now: float) -> None:
        day = math.floor(now / 86400)
        for back in range(_DEFERRED_DAYS + 1):
            table = f"jobs:{day - back}"
            if self.counters.counter(table, key) > 0:
                self.counters.count([(table, key, -1, (day - back + _DEFERRED_DAYS + 1)
                                      * 86400.0)])
                return

    # -- reports ---------------------------------------------------------------------------

    def problems(self, policy_set: PolicySet) -> list[str]:
        """Budgets this configuration cannot enforce (``cost_usd`` without prices)."""
        return budget_problems(list(policy_set.policies.values()), self.pricing)

    async def report(self, policy_set: PolicySet, *, sandbox: str | None,
                     policy: str | None, since: float | None, now: float,
                     by: str | None = None) -> dict[str, Any]:
        """The ``GET /v1/usage`` answer: rows, totals, budget status, degraded flag;
        with ``by`` (``hour`` or ``day``) also ``series``, the sums per bucket over time
        (``start`` an ISO time; ``cost_usd`` None without pricing)."""
        step = _STEPS.get(by) if by is not None else None
        if by is not None and step is None:
            raise ValueError(f"by {by[:16]!r} is not hour or day")
        start = (math.floor(since / 3600) * 3600 if since is not None
                 else math.floor((now - self.ledger.retention) / 3600) * 3600)
        rows, series = await self.ledger.summary(sandbox=sandbox, policy=policy, since=start,
                                                 now=now, step=step)
        if self.pricing is None:
            for row in (*rows, *series):
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
        out = {
            "since": _iso(start), "until": _iso(now), "sandbox": sandbox, "policy": policy,
            "degraded": self.counters.counters_degraded,
            "totals": summed, "rows": rows, "budgets": budgets,
        }
        if step is not None:
            out["by"] = by
            out["series"] = [{**b, "start": _iso(b["start"])} for b in series]
        return out


_STEPS = {"hour": HOUR, "day": DAY}
_JSON = json.JSONDecoder()


def _bounds(queue: list[_Pending]) -> list[Bound]:
    return [Bound(p.hold.reserved.tokens, p.hold.reserved.nano_usd, p.response_id)
            for p in queue]


def _string(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _event(data: bytes) -> dict[str, Any] | None:
    try:
        doc = document(data, _JSON)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _lane(data: bytes) -> str | None:
    """The ``stream_id`` of a Responses WebSocket event (None: the default lane)."""
    if b'"stream_id"' not in data:
        return None
    doc = _event(data)
    return _string(doc.get("stream_id")) if doc is not None else None


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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
                    telemetry=telemetry)


def static_metering(pricing: Pricing | None = None) -> Metering:
    """A metering step over counters that stay empty: its answers depend on the request
    alone, however many it gives (nothing is used, nothing recorded), and its refusals
    are not counted in the gateway's metrics (an explain is not traffic). ``pricing``:
    the gateway's, for cost budgets. What ``policy explain``, ``policy test``, replay
    and the console give ``core/evaluate`` as its ``Metering`` port."""
    return Metering(EmptyCounters(), pricing=pricing, stream_usage=True)
