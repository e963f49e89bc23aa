"""A metered WebSocket session (OpenAI's Realtime and Responses APIs): each message from
the sandbox is checked before it is relayed (models, budgets; each ``response.create``
reserves its bound), and each server event read as relayed (a response that ends settles
the reservation ``core.metering.settling`` picks)."""

from __future__ import annotations

import json
from typing import Any

from gateway.core.metering.endpoints import Endpoint, body_json, field_of
from gateway.core.metering.jsondoc import document
from gateway.core.metering.models import check_event_models
from gateway.core.metering.refusals import BudgetExceeded, MeteringRefusal, StepRefusal
from gateway.core.metering.settling import Bound, all_unread, ending
from gateway.core.metering.usage import SessionMeter, Usage
from gateway.core.policy.model import Rule
from gateway.core.ports import Telemetry
from gateway.services.metering.budgets import NANO, BudgetBook, Hold, Reservation
from gateway.services.metering.exchange import Exchange, Pending
from gateway.services.metering.refusing import Refusals
from gateway.services.metering.settlement import Settlement
from gateway.services.metering.worst_case import WorstCase

__all__ = ["Sessions"]

_JSON = json.JSONDecoder()


class Sessions:
    """The session calls of the metering step, over its parts."""

    def __init__(self, budgets: BudgetBook, telemetry: Telemetry, refusals: Refusals,
                 worst: WorstCase, settlement: Settlement) -> None:
        self.budgets = budgets
        self.telemetry = telemetry
        self.refusals = refusals
        self.worst = worst
        self.settlement = settlement

    def session_message(self, exchange: Exchange, data: bytes, now: float) -> StepRefusal | None:
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
            return self.refusals.unavailable(policy, rule, (
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
            return self.refusals.unavailable(policy, rule, (
                f"a {str(kind)[:40]!r} message is none the gateway can meter on a Responses "
                "API session (only response.create and response.cancel)"))
        if meter.format == "realtime" and meter.auto_responses and kind in (
                "input_audio_buffer.append", "input_audio_buffer.commit"):
            return self.refusals.unavailable(policy, rule, (
                "this Realtime session may start responses on its own (turn detection with "
                "create_response), which cannot be reserved against the budget before they "
                "start; send session.update with turn_detection.create_response: false (or "
                "turn_detection: null) and a response.create for each response"))
        exceeded = self.budgets.check(exchange.sandbox, policy, exchange.credential, now,
                                      open_session=Usage())
        if exceeded is not None:
            self.telemetry.count("budget_refusals", policy.name, exceeded.budget.name)
        return exceeded

    def _session_request(self, exchange: Exchange, now: float) -> StepRefusal | None:
        """A Realtime ``response.create`` on a rule with a requests budget only: one
        more request (no tokens to reserve)."""
        admitted = self.budgets.admit(exchange.sandbox, exchange.policy, exchange.credential,
                                      now, Reservation())
        if isinstance(admitted, BudgetExceeded):
            self.telemetry.count("budget_refusals", exchange.policy.name,
                                 admitted.budget.name)
            return admitted
        if isinstance(admitted, MeteringRefusal):
            self.telemetry.count("metering_refusals", exchange.policy.name, admitted.code)
            return admitted
        if admitted is not None:
            self.budgets.settle(admitted, 0, 0)
        return None

    def _reserve_response(self, exchange: Exchange, rule: Rule, fields: dict[str, Any],
                          data: bytes, now: float) -> StepRefusal | None:
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
        found = self.worst.bound(rule, request, model, "", data,
                           {**own, "previous_response_id": "(the session's state)"}
                           if meter.format == "realtime" or own.get("previous_response_id")
                           else own)
        if isinstance(found, str):
            return self.refusals.unavailable(policy, rule, found)
        input_tokens, output_tokens = found
        reserve = self.budgets.reservation(policy, exchange.credential, model, input_tokens,
                                           0 if warm_up else output_tokens)
        if isinstance(reserve, str):
            return self.refusals.unavailable(policy, rule, reserve)
        admitted = self.budgets.admit(exchange.sandbox, policy, exchange.credential, now,
                                      reserve, requests=0 if warm_up else 1)
        if isinstance(admitted, BudgetExceeded):
            self.telemetry.count("budget_refusals", policy.name, admitted.budget.name)
            return admitted
        if isinstance(admitted, MeteringRefusal):
            self.telemetry.count("metering_refusals", policy.name, admitted.code)
            return admitted
        if isinstance(admitted, Hold):
            lane = _string(fields.get("stream_id"))
            if exchange.pending is None:
                exchange.pending = {}
            exchange.pending.setdefault(lane, []).append(
                Pending(hold=admitted, event_id=_string(fields.get("event_id"))))
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
                self._release_refused(exchange, lane, queue, waiting)
            return
        self._settle_ended(exchange, lane, queue, usage, meter.last_id)

    def _release_refused(self, exchange: Exchange, lane: str | None, queue: list[Pending],
                         refused: Pending) -> None:
        """A queued ``response.create`` (``refused``, as the error tells) will not run:
        release the smallest reservation of the lane (whichever response it was, its own
        bound was at least that large) and forget the refused create (the entry left
        keeps the reservation the refused one held)."""
        index = ending(_bounds(queue), (0, 0), None).index  # (a usage of 0: the smallest)
        assert index is not None  # (only an unread usage releases none)
        smallest = queue[index]
        self.budgets.settle(smallest.hold, 0, 0)
        smallest.hold = refused.hold
        queue.remove(refused)
        self._settle_unread(exchange, lane, queue)

    def _settle_ended(self, exchange: Exchange, lane: str | None, queue: list[Pending],
                      usage: Usage, response_id: str | None) -> None:
        """A response of the session ended with ``usage``: settle the reservation
        ``core.metering.settling`` picks (not the one its id names: ids are tied to
        reservations by an order the provider need not keep), or, its usage unread,
        count it and hold on (see ``_settle_unread``)."""
        used: tuple[int, int] | None = None
        if usage.known:
            cost = (self.budgets.cost(usage)
                    if any(b.cost_usd is not None for b in exchange.policy.budgets) else None)
            used = (usage.tokens, round((cost or 0.0) * NANO))
        chosen = ending(_bounds(queue), used, response_id)
        if chosen.index is None:
            unread = exchange.unread if exchange.unread is not None else {}
            unread[lane] = unread.get(lane, 0) + 1
            exchange.unread = unread
        else:
            self.settlement.settle(exchange, queue.pop(chosen.index).hold, usage, sent=True,
                                   status=200)
        self._settle_unread(exchange, lane, queue)

    def _settle_unread(self, exchange: Exchange, lane: str | None,
                       queue: list[Pending]) -> None:
        """When every reservation left on ``lane`` is one of a response that ended with
        its usage unread, charge each in full (no response still running can need it)."""
        unread = exchange.unread.get(lane, 0) if exchange.unread is not None else 0
        if not all_unread(len(queue), unread):
            return
        for pending in queue:
            self.settlement.settle(exchange, pending.hold, Usage(), sent=True, status=200)
        queue.clear()
        assert exchange.unread is not None
        exchange.unread[lane] = 0


def _bounds(queue: list[Pending]) -> list[Bound]:
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
