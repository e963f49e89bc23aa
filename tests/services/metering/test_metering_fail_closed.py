"""The metering step fails closed: on a rule that must be metered (a token or cost
budget, or `metering: required`) an inference call is metered or refused; provider-minted
secrets are refused or bound; what cannot be modelled is denied by default. Each way
around the meter found on the previous `main` is a row here (see the metering issue's
"Why"); those of its parts are in their own files: reservations settling
(test_metering_settlement.py), bounds (test_metering_worst_case.py), deferred jobs
(test_metering_deferred.py), WebSocket sessions (test_metering_sessions.py)."""

from __future__ import annotations

import gzip
import json
from typing import Any

import pytest
from helpers.metering_step import AZURE, NOW, POLICY, UNMETERED_POLICY, admit

from gateway.core.metering import ModelRefusal
from gateway.core.metering.endpoints import classify
from gateway.core.metering.estimate import (
    INLINE_TOKENS,
    estimate_input,
)
from gateway.core.policy import PolicySet
from gateway.services.metering import Exchange, Metering, MeteringRefusal
from gateway.services.metering.budgets import BudgetExceeded
from gateway.services.policy import load_policy_texts

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


def test_typical_input_estimate() -> None:
    """What reports show as a call's likely input (never a budget's bound)."""
    assert estimate_input(b"x" * 400) == 100
    assert estimate_input(b"{" + b" \n\t\r" * 1_000_000 + b"}") == 1  # layout is free
    image = b'{"data": "' + b"A" * 500_000 + b'", "text": "' + b"y" * 400 + b'"}'
    assert estimate_input(image) == INLINE_TOKENS + (len(image) - 500_000 - 3 + 3) // 4


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


def test_classification_reads_the_route_once() -> None:
    for spelling in ("/v1/chat/completions", "/v1/chat/completion%73", "//v1/chat/completions/",
                     "/v1/chat/%63ompletions"):
        endpoint = classify("POST", spelling)
        assert endpoint is not None and endpoint.format == "openai", spelling


# -- issue 39: a budget is a ceiling --------------------------------------------------------

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

