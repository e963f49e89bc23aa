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
