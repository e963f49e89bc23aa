"""A metered WebSocket session (gateway/services/metering/sessions.py): each message from
the sandbox is checked before it is relayed (models, budgets), each response.create
reserves its bound and settles when its response ends; Realtime's automatic responses
are refused on a budgeted rule until turned off; a Codex warm-up is no request."""

from __future__ import annotations

import json

import pytest
from helpers.metering_step import AZURE, NOW, admit

from gateway.core.metering.usage import SessionMeter
from gateway.core.policy import PolicySet
from gateway.core.policy.compiled import Policy
from gateway.services.metering import Exchange, Metering, MeteringRefusal
from gateway.services.metering.budgets import BudgetExceeded
from gateway.services.metering.catalogue import catalogue
from gateway.services.policy import load_policy_texts


def session(metering: Metering, policies: PolicySet, path: str) -> Exchange:
    step = admit(metering, policies, AZURE, "GET", path)
    assert isinstance(step, Exchange) and isinstance(step.meter, SessionMeter)
    return step


def test_responses_websocket_session(metering: Metering, policies: PolicySet) -> None:
    """4. The Responses API over WebSocket: each response.create is a call (checked,
    reserved), settled by its response.completed; an error before it began frees it."""
    step = session(metering, policies, "/openai/v1/responses")
    create = json.dumps({"type": "response.create", "model": "m", "max_output_tokens": 3000,
                         "input": "hi"}).encode()
    assert metering.session_message(step, create, NOW) is None
    assert metering.session_message(step, create, NOW) is None
    assert metering.session_message(step, create, NOW) is None
    refused = metering.session_message(step, create, NOW)  # 4 x ~3,016 > 10,000
    assert isinstance(refused, BudgetExceeded) and refused.retry_after == 5
    metering.session_event(step, b'{"type": "response.created", "response": {}}', NOW)
    metering.session_event(step, json.dumps({"type": "response.completed", "response": {
        "model": "m", "usage": {"input_tokens": 5, "output_tokens": 7}}}).encode(), NOW)
    metering.session_event(step, b'{"type": "error", "status": 400, "error": {}}', NOW)
    assert sum(len(q) for q in step.pending.values()) == 1
    done = metering.complete(step, 101, NOW)  # the last one never ended: its reservation
    assert done.usage is not None and done.usage.tokens == 12
    policy = policies.policies["agent"]
    book = metering.budgets
    used, held = book._used(book._table("agent", policy.budgets[0], 1794960000.0), "sb")
    assert used["tokens"] == 12 + 3000 + len(create) and held["tokens"] == 0
    assert used["requests"] == 3  # one per response.create that went out


@pytest.mark.parametrize(("message", "code"), [
    (b'{"type": "response.create", "model": "gpt-4o"}', "model_not_allowed"),
    (b'{"type": "response.create"}', "model_not_allowed"),  # names none
    (b'{"type": "session.update", "session": {"model": "gpt-4o"}}', "model_not_allowed"),
    (b'{"type": "response.create", "model": "gpt-4o-mini", "Model": "x"}',
     "metering_unavailable"),
    (b"not json", "metering_unavailable"),
])
def test_session_messages_are_checked(metering: Metering, policies: PolicySet,
                                      message: bytes, code: str) -> None:
    policy = policies.policies["agent"]
    rule = next(r for r in policy.rules if r.host == "api.openai.com")
    step = metering.admit(sandbox="sb", policy=policy, rule=rule, preset="openai",
                          method="GET", path="/v1/responses", body=None, now=NOW)
    assert isinstance(step, Exchange)
    refused = metering.session_message(step, message, NOW)
    assert refused is not None and refused.code == code
    ok = b'{"type": "response.create", "model": "gpt-4o-mini-2024"}'
    assert metering.session_message(step, ok, NOW) is None


REALTIME_POLICY = """\
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
budgets:
  - {name: daily, per: sandbox, window: 24h, tokens: 100000}
credentials:
  openai: {preset: openai, secret: k1}
"""


def test_realtime_responses_reserve_each_its_bound(metering: Metering) -> None:
    """4. Each response.create, in or out of band, reserves its bound (the context window
    plus its output limit) before it is relayed; a parallel burst cannot overshoot."""
    step, policy = realtime(metering)
    info = catalogue().get("gpt-realtime")
    assert info is not None and info.context is not None
    create = json.dumps({"type": "response.create", "event_id": "e1", "response": {
        "conversation": "none", "max_output_tokens": 1000}}).encode()
    per = info.context + 1000
    admitted = 0
    for _ in range(100_000 // per + 2):
        if metering.session_message(step, create, NOW) is None:
            admitted += 1
    assert admitted == 100_000 // per
    book = metering.budgets
    used, held = book._used(book._table("agent", policy.budgets[0], 1794960000.0), "sb")
    assert held["tokens"] == admitted * per
    # a response that ends settles to its usage; an error naming the event frees one
    metering.session_event(step, b'{"type": "response.created", "response": {}}', NOW)
    metering.session_event(step, json.dumps({"type": "response.done", "response": {
        "usage": {"input_tokens": 50, "output_tokens": 70}}}).encode(), NOW)
    metering.session_event(step, b'{"type": "error", "error": {"event_id": "other"}}', NOW)
    metering.session_event(step, b'{"type": "error", "error": {"event_id": "e1"}}', NOW)
    used, held = book._used(book._table("agent", policy.budgets[0], 1794960000.0), "sb")
    assert used["tokens"] == 120 and held["tokens"] == (admitted - 2) * per
    metering.complete(step, 101, NOW)  # the rest never ended: charged their reservation
    used, held = book._used(book._table("agent", policy.budgets[0], 1794960000.0), "sb")
    assert used["tokens"] == 120 + (admitted - 2) * per and held["tokens"] == 0


def test_realtime_automatic_responses_are_refused_until_turned_off(metering: Metering) -> None:
    step, _ = realtime(metering)
    audio = b'{"type": "input_audio_buffer.append", "audio": "AAAA"}'
    refused = metering.session_message(step, audio, NOW)
    assert isinstance(refused, MeteringRefusal) and "create_response" in refused.reason
    metering.session_event(step, json.dumps({"type": "session.updated", "session": {
        "turn_detection": {"type": "server_vad", "create_response": False}}}).encode(), NOW)
    assert metering.session_message(step, audio, NOW) is None


def test_codex_warm_up_is_no_request(metering: Metering, policies: PolicySet) -> None:
    """8. A generate: false response.create is no request and reserves no output."""
    step = session(metering, policies, "/openai/v1/responses")
    warm = json.dumps({"type": "response.create", "model": "m", "generate": False,
                       "max_output_tokens": 3000, "input": "hi"}).encode()
    assert metering.session_message(step, warm, NOW) is None
    assert step.pending is not None
    (pending,) = step.pending[None]
    assert pending.hold.reserved.tokens == len(warm)
    metering.session_event(step, b'{"type": "response.created", "response": {}}', NOW)
    metering.session_event(step, json.dumps({"type": "response.completed", "response": {
        "usage": {"input_tokens": 2, "output_tokens": 0}}}).encode(), NOW)
    metering.complete(step, 101, NOW)
    book = metering.budgets
    policy = policies.policies["agent"]
    used, _ = book._used(book._table("agent", policy.budgets[0], 1794960000.0), "sb")
    assert (used["requests"], used["tokens"]) == (0, 2)
    odd = metering.session_message(step, b'{"type": "session.update"}', NOW)
    assert isinstance(odd, MeteringRefusal)


def realtime(metering: Metering) -> tuple[Exchange, Policy]:
    policies = load_policy_texts({"agent.yaml": REALTIME_POLICY})
    policy = policies.policies["agent"]
    step = metering.admit(sandbox="sb", policy=policy, rule=policy.rules[0], preset="openai",
                          method="GET", path="/v1/realtime?model=gpt-realtime",
                          body=None, now=NOW)
    assert isinstance(step, Exchange) and isinstance(step.meter, SessionMeter)
    return step, policy


def _book(metering: Metering, policies: PolicySet) -> tuple[float, float]:
    """(settled, held) tokens of the sandbox's daily budget."""
    book = metering.budgets
    used, held = book._used(book._table("agent", policies.policies["agent"].budgets[0],
                                        1794960000.0), "sb")
    return used["tokens"], held["tokens"]


UNREAD = json.dumps({"type": "response.completed", "response": {"usage": None}}).encode()


@pytest.mark.parametrize(("what", "events", "settled"), [
    # (the events after a long and a short create; what is charged once all have ended)
    ("the long one ends unread, the short one read: the long bound held until the end",
     ["created", "created", UNREAD, ("used", 20)], "20+long"),
    ("the short one ends unread first: nothing released while the long one runs",
     ["created", "created", UNREAD, ("used", 2_900)], "2900+short"),
    ("both unread: each charged its own reservation", ["created", "created", UNREAD, UNREAD],
     "long+short"),
    ("an error before either began releases the short bound; the other unread",
     ["error", "created", UNREAD], "long"),
    ("an error while one runs may be that one's: nothing released",
     ["created", "error", UNREAD, UNREAD], "long+short"),
])
def test_a_session_charges_within_what_it_reserved(
        metering: Metering, policies: PolicySet, what: str,
        events: list[bytes | str | tuple[str, int]], settled: str) -> None:
    """A response whose usage the provider does not report could be either: it releases
    nothing until every response has ended, and then each reservation left is charged in
    full. At every step what is charged plus what is held stays within what was reserved
    (charging the largest bound for an unread response while releasing the smallest,
    as before, charged 2 x long)."""
    step = session(metering, policies, "/openai/v1/responses")
    creates = [json.dumps({"type": "response.create", "model": "m", "max_output_tokens": n,
                           "input": "hi"}).encode() for n in (3000, 30)]
    for create in creates:
        assert metering.session_message(step, create, NOW) is None
    long, short = (3000 + len(creates[0]), 30 + len(creates[1]))
    assert _book(metering, policies) == (0, long + short)
    for event in events:
        if event == "created":
            data = b'{"type": "response.created", "response": {}}'
        elif event == "error":
            data = b'{"type": "error", "status": 500, "error": {}}'
        elif isinstance(event, tuple):
            data = json.dumps({"type": "response.completed", "response": {
                "usage": {"input_tokens": 0, "output_tokens": event[1]}}}).encode()
        else:
            assert isinstance(event, bytes)
            data = event
        metering.session_event(step, data, NOW)
        used, held = _book(metering, policies)
        assert used + held <= long + short, (what, event, used, held)
    assert _book(metering, policies) == (eval(settled, {"long": long, "short": short}), 0)
    assert not step.pending or not any(step.pending.values())


def test_a_realtime_error_naming_one_create_releases_one_reservation(
        metering: Metering) -> None:
    """An error naming a queued create's event releases the smallest reservation once;
    the same error again (a provider repeating itself) releases nothing more."""
    step, policy = realtime(metering)
    for event_id, limit in (("big", 4000), ("small", 10)):
        assert metering.session_message(step, json.dumps({
            "type": "response.create", "event_id": event_id, "response": {
                "conversation": "none", "max_output_tokens": limit}}).encode(), NOW) is None
    book = metering.budgets
    table = book._table("agent", policy.budgets[0], 1794960000.0)
    held = book._used(table, "sb")[1]["tokens"]
    error = b'{"type": "error", "error": {"event_id": "big"}}'
    metering.session_event(step, error, NOW)
    after = book._used(table, "sb")[1]["tokens"]
    assert step.pending is not None
    (left,) = step.pending[None]
    assert left.hold.reserved.tokens == after > held - after  # the smaller one went
    metering.session_event(step, error, NOW)
    again = book._used(table, "sb")[1]["tokens"]
    assert again == after and len(step.pending[None]) == 1
