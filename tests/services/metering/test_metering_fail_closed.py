"""The metering step fails closed: on a rule that must be metered (a token or cost
budget, or `metering: required`) an inference call is metered or refused; reservations
settle to what a call used, or to the reservation when its usage never arrives;
deferred jobs are metered when retrieved; provider-minted secrets are refused or bound;
WebSocket sessions are checked message by message. Each way around the meter found on
the previous `main` is a row here (see the metering issue's "Why")."""

from __future__ import annotations

import gzip
import json
from typing import Any

import pytest

from gateway.core.metering import ModelRefusal
from gateway.core.metering.endpoints import classify
from gateway.core.metering.estimate import (
    INLINE_TOKENS,
    estimate_input,
)
from gateway.core.metering.usage import SessionMeter
from gateway.core.policy import PolicySet
from gateway.core.policy.compiled import Policy
from gateway.services.metering import Exchange, Metering, MeteringRefusal
from gateway.services.metering.budgets import BudgetExceeded
from gateway.services.metering.catalogue import catalogue
from gateway.services.policy import load_policy_texts
from gateway.services.state.memory_counters import MemoryCounters

NOW = 1_795_000_000.0
POLICY = """\
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
    models: ["gpt-4o-mini*"]
  - host: budgeted.openai.azure.com
    credential: azure
  - host: api.anthropic.com
    credential: anthropic
    metering: {required: true, reserve: 100}
  - host: api.groq.com
    credential: groq
  - host: llm.internal.test
    credential: custom
    metering: required
budgets:
  - {name: daily, per: sandbox, window: 24h, tokens: 10000, credentials: [azure]}
credentials:
  openai: {preset: openai, secret: k1}
  azure: {preset: azure-openai, secret: k2, hosts: [budgeted.openai.azure.com]}
  anthropic: {preset: anthropic, secret: k3}
  groq: {preset: groq, secret: k4}
  custom: {hosts: [llm.internal.test], secret: k5, inject: {bearer: true}}
"""


@pytest.fixture
def policies() -> PolicySet:
    return load_policy_texts({"agent.yaml": POLICY})


@pytest.fixture
def metering() -> Metering:
    return Metering(MemoryCounters(lambda: NOW))


def admit(metering: Metering, policies: PolicySet, host: str, method: str, path: str,
          body: Any = None, sandbox: str = "sb") -> Any:
    policy = policies.policies["agent"]
    rule = next(r for r in policy.rules if r.host == host)
    assert rule.credential is not None
    preset = policies.credentials[rule.credential].preset
    raw = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    return metering.admit(sandbox=sandbox, policy=policy, rule=rule, preset=preset,
                          method=method, path=path, body=raw, now=NOW)


AZURE = "budgeted.openai.azure.com"
STREAM = {"model": "gpt-4o-mini", "messages": [], "stream": True, "max_tokens": 10}


@pytest.mark.parametrize(("host", "method", "path", "body", "code", "says"), [
    # 2. bodies the meter could not read: not held (streamed, over the hold limit)
    (AZURE, "POST", "/openai/v1/chat/completions", None, "metering_unavailable",
     "was not available to read"),
    ("api.anthropic.com", "POST", "/v1/messages", None, "metering_unavailable",
     "not available"),
    # ...or not one JSON object the way the provider reads it (6. case variants)
    (AZURE, "POST", "/openai/v1/chat/completions", b"[1]", "metering_unavailable",
     "not one JSON object"),
    (AZURE, "POST", "/openai/v1/chat/completions",
     b'{"model": "m", "stream": false, "Stream": true}', "metering_unavailable",
     '"model" and "Model"'),
    # 6. an Azure api-version that cannot carry stream usage
    (AZURE, "POST", "/openai/deployments/d/chat/completions?api-version=2024-06-01", STREAM,
     "metering_unavailable", "api-version 2024-06-01 cannot report its usage"),
    (AZURE, "POST", "/openai/deployments/d/chat/completions", STREAM,
     "metering_unavailable", "api-version none"),
    # 4/5. deferred work on a budgeted rule: its usage is not known when it is answered
    (AZURE, "POST", "/openai/v1/responses", {"model": "m", "background": True},
     "metering_unavailable", "a background response"),
    (AZURE, "POST", "/openai/batches", {"input_file_id": "f"}, "metering_unavailable",
     "the OpenAI Batch API"),
    ("api.anthropic.com", "POST", "/v1/messages/batches", {"requests": []},
     "metering_unavailable", "Anthropic Message Batches"),
    # inference the gateway cannot read the usage of
    ("api.anthropic.com", "POST", "/v1/complete", {"prompt": "x"}, "metering_unavailable",
     "legacy Text Completions"),
    (AZURE, "POST", "/openai/v1/images/generations", {"prompt": "x"},
     "metering_unavailable", "image generation"),
    (AZURE, "POST", "/openai/v1/realtime/calls", b"v=0", "metering_unavailable",
     "a WebRTC Realtime call"),
    # 5. provider-minted secrets: refused unless the rule opts in
    ("api.openai.com", "POST", "/v1/realtime/client_secrets",
     {"session": {"model": "gpt-4o-mini-realtime"}}, "minted_secret_refused",
     "allow_minted_secrets: true"),
    ("api.openai.com", "POST", "/v1//realtime/session%73/",
     {"model": "gpt-4o-mini-realtime"}, "minted_secret_refused", "allow_minted_secrets"),
    # 6. case-variant duplicates are refused like exact duplicates by the allowlist
    ("api.openai.com", "POST", "/v1/chat/completions",
     b'{"model": "gpt-4o-mini", "Model": "gpt-4o"}', "model_not_allowed",
     "repeats a key"),
    # a call larger than the whole budget
    (AZURE, "POST", "/openai/v1/chat/completions", {"model": "m", "max_tokens": 10001},
     "budget_exceeded", "this call may use up to"),
])
def test_refused_when_it_cannot_be_metered(metering: Metering, policies: PolicySet,
                                           host: str, method: str, path: str, body: Any,
                                           code: str, says: str) -> None:
    step = admit(metering, policies, host, method, path, body)
    assert isinstance(step, MeteringRefusal | ModelRefusal | BudgetExceeded), step
    assert step.code == code and says in step.reason, step.reason
    assert step.rule.startswith("agent.yaml:")
    if code == "metering_unavailable":
        assert "every inference call must be metered here" in step.reason


@pytest.mark.parametrize(("host", "path", "body", "asked"), [
    # 1. another spelling of the endpoint still gets the usage option
    ("api.openai.com", "/v1/chat/completion%73", STREAM, True),
    ("api.openai.com", "/v1//chat/completions/", STREAM, True),
    ("api.openai.com", "/v1/completions/", {**STREAM, "prompt": "x"}, True),
    # Azure: recent api-version and the v1 API ask for it; required custom hosts too
    (AZURE, "/openai/deployments/d/chat/completions?api-version=2024-10-21", STREAM, True),
    (AZURE, "/openai/v1/chat/completions", STREAM, True),
    ("llm.internal.test", "/v1/chat/completions", STREAM, True),
    # providers that stream usage unasked, and calls that are not streamed
    ("api.groq.com", "/openai/v1/chat/completions", STREAM, False),
    ("api.openai.com", "/v1/chat/completions", {**STREAM, "stream": False}, False),
    ("api.openai.com", "/v1/responses", STREAM, False),  # (response.completed has it)
])
def test_stream_usage_is_asked_for(metering: Metering, policies: PolicySet, host: str,
                                   path: str, body: dict[str, Any], asked: bool) -> None:
    step = admit(metering, policies, host, "POST", path, body)
    assert isinstance(step, Exchange), step
    if asked:
        assert step.body is not None
        assert json.loads(step.body)["stream_options"] == {"include_usage": True}
    else:
        assert step.body is None


def test_a_compressed_body_is_read_decoded(metering: Metering, policies: PolicySet) -> None:
    """(2.) The core hands the metering step the decoded body; here: what it reads."""
    decoded = json.dumps(STREAM).encode()
    assert gzip.decompress(gzip.compress(decoded)) == decoded
    step = admit(metering, policies, AZURE, "POST", "/openai/v1/chat/completions", decoded)
    assert isinstance(step, Exchange) and step.body is not None


def test_reservation_settles_to_usage_or_to_itself(metering: Metering,
                                                   policies: PolicySet) -> None:
    """3. A burst cannot overshoot; a stream cut before its usage counts its
    reservation; a provider error counts nothing; a request never sent counts nothing."""
    body = {"model": "m", "messages": [], "max_tokens": 2000}
    reserved = 2000 + len(json.dumps(body).encode())  # (its output limit and its bytes)
    steps = []
    for _ in range(6):
        steps.append(admit(metering, policies, AZURE, "POST", "/openai/v1/chat/completions",
                           body))
    admitted = [s for s in steps if isinstance(s, Exchange)]
    assert len(admitted) == 10000 // reserved == 4
    assert all(isinstance(s, BudgetExceeded) and s.retry_after == 5 for s in steps[4:])
    usage = (b'{"model": "m", "usage": {"prompt_tokens": 10, "completion_tokens": 90}}')
    first, second, third, fourth = admitted
    first.feed(usage)
    done = metering.complete(first, 200, NOW)
    assert (done.reserved, done.charged, done.basis) == (reserved, 100, "usage")
    second.feed(b'data: {"choices": []}\n\n')  # cut off before its usage chunk
    done = metering.complete(second, 200, NOW)
    assert (done.charged, done.basis) == (reserved, "reservation")
    third.feed(b'{"error": {"message": "bad"}}')
    assert metering.complete(third, 400, NOW).charged == 0
    assert metering.complete(fourth, 0, NOW, sent=False).charged == 0
    book = metering.budgets
    policy = policies.policies["agent"]
    assert book.check("sb", policy, "azure", NOW) is None
    used, held = book._used(book._table("agent", policy.budgets[0], 1794960000.0), "sb")
    assert (used["tokens"], held["tokens"]) == (100 + reserved, 0)


def test_typical_input_estimate() -> None:
    """What reports show as a call's likely input (never a budget's bound)."""
    assert estimate_input(b"x" * 400) == 100
    assert estimate_input(b"{" + b" \n\t\r" * 1_000_000 + b"}") == 1  # layout is free
    image = b'{"data": "' + b"A" * 500_000 + b'", "text": "' + b"y" * 400 + b'"}'
    assert estimate_input(image) == INLINE_TOKENS + (len(image) - 500_000 - 3 + 3) // 4


def test_background_jobs_are_metered_once_when_retrieved(metering: Metering,
                                                         policies: PolicySet) -> None:
    """4. On a rule without a budget: the job's id is remembered; its retrieval is
    metered when it carries usage, once; a retrieval of anything else is not."""
    step = admit(metering, policies, "api.openai.com", "POST", "/v1/responses",
                 {"model": "gpt-4o-mini", "background": True})
    assert isinstance(step, Exchange) and step.deferred == "response" and step.meter is None
    step.feed(b'{"id": "resp_bg1", "status": "queued", "usage": null}')
    assert metering.complete(step, 200, NOW).as_record() is None
    pending = admit(metering, policies, "api.openai.com", "GET", "/v1/responses/resp_bg1")
    assert isinstance(pending, Exchange) and pending.retrieval is not None
    pending.feed(b'{"id": "resp_bg1", "status": "in_progress", "usage": null}')
    assert metering.complete(pending, 200, NOW).as_record() is None  # not done yet
    done = admit(metering, policies, "api.openai.com", "GET", "/v1/responses/resp_bg1/")
    assert isinstance(done, Exchange) and done.retrieval is not None
    done.feed(b'{"id": "resp_bg1", "status": "completed", "model": "gpt-4o-mini", '
              b'"usage": {"input_tokens": 12, "output_tokens": 30}}')
    record = metering.complete(done, 200, NOW).as_record()
    assert record is not None and (record["input_tokens"], record["output_tokens"]) == (12, 30)
    again = admit(metering, policies, "api.openai.com", "GET", "/v1/responses/resp_bg1")
    assert isinstance(again, Exchange) and again.retrieval is None and again.meter is None
    other = admit(metering, policies, "api.openai.com", "GET", "/v1/responses/resp_other")
    assert isinstance(other, Exchange) and other.meter is None


def test_minted_secret_is_bound_when_allowed(metering: Metering) -> None:
    policies = load_policy_texts({"agent.yaml": POLICY.replace(
        '    models: ["gpt-4o-mini*"]\n',
        '    models: ["gpt-4o-mini*"]\n    allow_minted_secrets: true\n')})
    step = admit(metering, policies, "api.openai.com", "POST", "/v1/realtime/client_secrets",
                 {"session": {"type": "realtime", "model": "gpt-4o-mini-realtime"}})
    assert isinstance(step, Exchange) and step.holds_response
    body = b'{"value": "ek_0123456789abcdef", "expires_at": ' + str(NOW + 60).encode() + b"}"
    released = metering.release(step, 200, body, NOW)  # the secret replaced by an alias
    assert isinstance(released, bytes) and b"ek_0123456789abcdef" not in released
    key = metering.ephemeral.by_alias(json.loads(released)["value"])
    assert key is not None and (key.credential, key.sandbox) == ("openai", "sb")
    assert key.value.equals("ek_0123456789abcdef")
    # An answer that names no secret is not relayed (it could not be bound).
    step = admit(metering, policies, "api.openai.com", "POST", "/v1/realtime/sessions",
                 {"model": "gpt-4o-mini-realtime"})
    assert isinstance(step, Exchange)
    assert isinstance(metering.release(step, 200, b'{"id": "sess"}', NOW), str)
    assert metering.release(step, 401, b'{"error": {}}', NOW) == b'{"error": {}}'


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


def test_classification_reads_the_route_once() -> None:
    for spelling in ("/v1/chat/completions", "/v1/chat/completion%73", "//v1/chat/completions/",
                     "/v1/chat/%63ompletions"):
        endpoint = classify("POST", spelling)
        assert endpoint is not None and endpoint.format == "openai", spelling




# -- issue 39: a budget is a ceiling --------------------------------------------------------

UNMETERED_POLICY = """\
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
    unmetered: ["/v1/assistants/**", "/v1/images/generations"]
    metering: {max_input_tokens: 5000}
budgets:
  - {name: daily, per: sandbox, window: 24h, tokens: 200000}
credentials:
  openai: {preset: openai, secret: k1}
"""


@pytest.mark.parametrize(("method", "path", "allowed"), [
    # explicitly not inference: passes
    ("GET", "/v1/models", True), ("GET", "/v1/models/gpt-4o", True),
    ("POST", "/v1/messages/count_tokens", True), ("POST", "/v1/files", True),
    ("DELETE", "/v1/responses/resp_1", True), ("GET", "/v1/responses/resp_1/input_items", True),
    ("POST", "/v1beta/models/gemini-2.5-pro:countTokens", True),
    # unknown endpoints, methods and spellings: refused naming the endpoint
    ("PUT", "/v1/chat/completions", False), ("PATCH", "/v1/chat/completions", False),
    ("POST", "/V1/CHAT/COMPLETIONS", False), ("POST", "/v1/chat/completions;x=1", False),
    ("POST", "/openai/deployments/d/Chat/Completions", False),
    ("POST", "/v1/models", False), ("POST", "/v1/brand-new-endpoint", False),
    ("POST", "/v1/projects/p/locations/l/endpoints/1:predict", False),
    ("POST", "/v1/projects/p/locations/l/endpoints/openapi:chatCompletions", False),
    ("POST", "/model/m/async-invoke", False), ("POST", "/v1/conversations", False),
    ("POST", "/v1/ocr", False), ("POST", "/v1beta/cachedContents", False),
    ("POST", "/v1beta/interactions", False), ("POST", "/v1/containers", False),
])
def test_default_deny_for_the_unmodelled(metering: Metering, policies: PolicySet,
                                         method: str, path: str, allowed: bool) -> None:
    """2. On a budgeted rule a request is metered inference or explicitly not inference;
    anything else is refused metering_unavailable naming it."""
    body = {"model": "gpt-4o-mini", "max_tokens": 10} if method != "GET" else None
    step = admit(metering, policies, AZURE, method, path, body)
    if allowed:
        assert isinstance(step, Exchange), getattr(step, "reason", step)
    else:
        assert isinstance(step, MeteringRefusal) and step.code == "metering_unavailable"
        assert "unmetered:" in step.reason and path.split(";")[0][:20] in step.reason
    # the same request on a rule that need not be metered passes unmetered
    assert isinstance(admit(metering, policies, "api.groq.com", method, path, body), Exchange)


def test_unmetered_paths_let_the_operator_through_knowingly(metering: Metering) -> None:
    policies = load_policy_texts({"agent.yaml": UNMETERED_POLICY})
    policy = policies.policies["agent"]
    rule = policy.rules[0]
    assert rule.unmetered_set is not None and "unmetered: " in rule.describe()

    def go(method: str, path: str, body: Any = None) -> Any:
        raw = json.dumps(body).encode() if body is not None else None
        return metering.admit(sandbox="sb", policy=policy, rule=rule, preset="openai",
                              method=method, path=path, body=raw, now=NOW)

    assert isinstance(go("POST", "/v1/assistants/asst_1", {}), Exchange)
    assert isinstance(go("POST", "/v1/images/generations", {"prompt": "x"}), Exchange)
    assert isinstance(go("POST", "/v1/audio/speech", {}), MeteringRefusal)
    # a chained call on a model the catalogue does not know: the rule's max_input_tokens
    chained = go("POST", "/v1/responses", {"model": "in-house-1", "max_output_tokens": 100,
                                           "previous_response_id": "resp_1"})
    assert isinstance(chained, Exchange) and chained.hold is not None
    assert chained.hold.reserved.tokens == 5000 + 100


@pytest.mark.parametrize(("body", "reserved"), [
    # two output limits: the larger one, as the provider may honour it
    ({"model": "gpt-4o-mini", "max_completion_tokens": 1, "max_tokens": 1600}, 1600),
    # numbers in other forms
    ({"model": "gpt-4o-mini", "max_tokens": 1e3}, 1000),
    ({"model": "gpt-4o-mini", "max_tokens": 100, "n": "8"}, 800),
    # no limit: the model's maximum output from the catalogue
    ({"model": "gpt-4o-mini"}, 16384),
])
def test_reservations_are_bounds(metering: Metering, body: dict[str, Any],
                                 reserved: int) -> None:
    policies = load_policy_texts({"agent.yaml": UNMETERED_POLICY})
    policy = policies.policies["agent"]
    raw = json.dumps(body).encode()
    step = metering.admit(sandbox="sb", policy=policy, rule=policy.rules[0], preset="openai",
                          method="POST", path="/v1/chat/completions", body=raw, now=NOW)
    assert isinstance(step, Exchange) and step.hold is not None
    assert step.hold.reserved.tokens == reserved + len(raw)


@pytest.mark.parametrize(("body", "words"), [
    ({"model": "gpt-4o-mini", "max_tokens": True}, "max_tokens is true"),
    ({"model": "gpt-4o-mini", "max_tokens": "lots"}, 'max_tokens is "lots"'),
    ({"model": "gpt-4o-mini", "max_tokens": 5, "n": -1}, "n is negative"),
    ({"model": "m", "messages": []}, "names no output limit"),
    ({"model": "m", "max_tokens": 5, "previous_response_id": "r"}, "context window"),
    ({"model": "gpt-4o-mini", "max_tokens": 5, "tools": [{"type": "web_search"}]},
     "max_tool_calls"),
])
def test_calls_without_a_bound_are_refused(metering: Metering, policies: PolicySet,
                                           body: dict[str, Any], words: str) -> None:
    step = admit(metering, policies, AZURE, "POST", "/openai/v1/responses", body)
    assert isinstance(step, MeteringRefusal) and step.code == "metering_unavailable"
    assert words in step.reason


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


def realtime(metering: Metering) -> tuple[Exchange, Policy]:
    policies = load_policy_texts({"agent.yaml": REALTIME_POLICY})
    policy = policies.policies["agent"]
    step = metering.admit(sandbox="sb", policy=policy, rule=policy.rules[0], preset="openai",
                          method="GET", path="/v1/realtime?model=gpt-realtime",
                          body=None, now=NOW)
    assert isinstance(step, Exchange) and isinstance(step.meter, SessionMeter)
    return step, policy


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
