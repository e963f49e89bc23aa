"""Refusal rendering: status, reason phrase, Proxy-Status, provider shapes."""

from __future__ import annotations

import json

import pytest

from gateway.core.refusal import AGENT_HINT, Refusal, answer, status_of, to_http1


@pytest.mark.parametrize(("code", "status"), [
    ("policy_denied", 403), ("auth_required", 407), ("token_expired", 407),
    ("too_many_connections", 429), ("budget_exceeded", 429), ("upstream_failed", 502),
    ("upstream_timeout", 504), ("secret_unavailable", 503), ("bad_request", 400),
    ("credential_requires_tls", 403), ("model_not_allowed", 403), ("gateway_error", 500),
])
def test_status(code: str, status: int) -> None:
    assert status_of(code) == status


def test_generic_body_and_headers() -> None:
    ans = answer(Refusal("policy_denied", "no rule allows x", "p.yaml:3"))
    body = json.loads(ans.body)
    assert body["error"] == "policy_denied" and body["rule"] == "p.yaml:3"
    assert body["reason"] == "no rule allows x" and "egress gateway" in body["hint"]
    assert ans.headers.get("X-Sandbox-Gateway-Error") == "policy_denied"
    assert ans.headers.get("Proxy-Status") == (
        'sandbox-gateway; error=http_request_denied; details="policy_denied: no rule allows x"')
    assert ans.reason == f"policy_denied: no rule allows x ({AGENT_HINT})"
    wire = to_http1(ans)
    assert wire.startswith(b"HTTP/1.1 403 policy_denied: no rule allows x (refused by the")
    assert wire.endswith(ans.body)


@pytest.mark.parametrize(("shape", "path", "kind"), [
    ("openai", ("error", "code"), ("error", "type")),
    ("anthropic", ("error", "code"), ("error", "type")),
    ("gemini", ("error", "details", 0, "reason"), ("error", "status")),
])
def test_provider_shapes(shape: str, path: tuple[object, ...], kind: tuple[str, ...]) -> None:
    body = json.loads(answer(Refusal("model_not_allowed", "gpt-5 is not allowed"),
                             shape=shape).body)
    node: object = body
    for key in path:
        node = node[key]  # type: ignore[index]
    assert node == "model_not_allowed"
    assert "gpt-5 is not allowed" in json.dumps(body)


def test_407_asks_for_credentials_and_closes() -> None:
    ans = answer(Refusal("auth_required", "no token"))
    assert ans.close and ans.headers.get("Proxy-Authenticate")


def test_retry_after_and_unsafe_phrase() -> None:
    ans = answer(Refusal("budget_exceeded", "limit\r\nInjected: x", retry_after=30))
    assert ans.headers.get("Retry-After") == "30"
    assert "\r" not in ans.reason and "\n" not in ans.reason
    assert "\r\n" not in (ans.headers.get("Proxy-Status") or "")


def test_long_reason_is_cut_before_the_hint() -> None:
    ans = answer(Refusal("budget_exceeded", "x" * 5000))
    assert len(ans.reason) <= 1000
    assert ans.reason.startswith("budget_exceeded: xxx") and ans.reason.endswith(f"({AGENT_HINT})")
    assert "..." in ans.reason


def test_websocket_error_events_in_the_providers_shapes() -> None:
    """A refused WebSocket message is answered as the provider's own error event."""
    import json

    from gateway.core.refusal import ws_error

    refusal = Refusal("budget_exceeded", "budget used up", "p.yaml:9", retry_after=5)
    responses = json.loads(ws_error(refusal, "responses_ws", stream_id="lane-2"))
    assert responses["type"] == "error" and responses["status"] == 429
    assert responses["stream_id"] == "lane-2"
    assert responses["error"]["code"] == "budget_exceeded"
    assert responses["error"]["type"] == "rate_limit_error"
    assert responses["error"]["message"].startswith("budget_exceeded: budget used up (")
    realtime = json.loads(ws_error(Refusal("model_not_allowed", "no"), "realtime"))
    assert realtime["type"] == "error" and realtime["event_id"]
    assert realtime["error"]["type"] == "invalid_request_error"
    assert realtime["error"]["code"] == "model_not_allowed"


# A used-up budget: (shape, retry_after) -> status, the body's type and code, and headers.
# Final (no room soon: retry_after None) is the provider's own quota answer, which SDKs
# and agents stop on; room again soon keeps the rate-limit shape and its Retry-After.
QUOTA_ROWS = [
    ("openai", None, 429, ("error", "type"), "insufficient_quota",
     ("error", "code"), "insufficient_quota"),
    ("openai", 5, 429, ("error", "type"), "rate_limit_error", ("error", "code"),
     "budget_exceeded"),
    ("anthropic", None, 400, ("error", "type"), "invalid_request_error", ("error", "code"),
     "budget_exceeded"),
    ("anthropic", 120, 429, ("error", "type"), "rate_limit_error", ("error", "code"),
     "budget_exceeded"),
    ("gemini", None, 429, ("error", "status"), "RESOURCE_EXHAUSTED",
     ("error", "details", 1, "retryDelay"), "7200s"),
    ("gemini", 5, 429, ("error", "status"), "RESOURCE_EXHAUSTED",
     ("error", "details", 1, "retryDelay"), "5s"),
    (None, None, 429, ("error",), "budget_exceeded", ("rule",), "b.yaml:8"),
    (None, 5, 429, ("error",), "budget_exceeded", ("rule",), "b.yaml:8"),
]


def _at(doc: object, path: tuple[object, ...]) -> object:
    for key in path:
        doc = doc[key]  # type: ignore[index]
    return doc


@pytest.mark.parametrize(("shape", "retry_after", "status", "kind_at", "kind", "code_at",
                          "code"), QUOTA_ROWS)
def test_a_used_up_budget_in_each_shape(shape: str | None, retry_after: int | None,
                                        status: int, kind_at: tuple[object, ...], kind: str,
                                        code_at: tuple[object, ...], code: str) -> None:
    refusal = Refusal("budget_exceeded", 'budget "daily" (b.yaml:8) is used up', "b.yaml:8",
                      retry_after=retry_after, resets_in=7200 if retry_after is None else 5)
    assert refusal.final_quota is (retry_after is None)
    ans = answer(refusal, shape=shape)
    body = json.loads(ans.body)
    assert ans.status == status and _at(body, kind_at) == kind and _at(body, code_at) == code
    # The gateway's own code stays visible to people, whatever the shape.
    assert ans.headers.get("X-Sandbox-Gateway-Error") == "budget_exceeded"
    assert 'details="budget_exceeded: budget \\"daily\\"' in (ans.headers.get("Proxy-Status")
                                                             or "")
    assert ans.reason.startswith("budget_exceeded: budget")
    assert "budget_exceeded: budget" in json.dumps(body) or shape is None
    if retry_after is None:  # waiting would not help: no Retry-After, and the SDKs told so
        assert ans.headers.get("Retry-After") is None
        assert ans.headers.get("x-should-retry") == "false"
    else:
        assert ans.headers.get("Retry-After") == str(retry_after)
        assert ans.headers.get("x-should-retry") is None


def test_gemini_quota_details_are_typed() -> None:
    """What the Gemini CLI reads (`classifyGoogleError`): a QuotaFailure, a RetryInfo
    past 300 s (terminal: it stops and shows the message), and an ErrorInfo."""
    body = json.loads(answer(Refusal("budget_exceeded", "used up", "b.yaml:8",
                                     resets_in=7200), shape="gemini").body)
    details = body["error"]["details"]
    assert [d["@type"].rsplit(".", 1)[1] for d in details] == [
        "QuotaFailure", "RetryInfo", "ErrorInfo"]
    assert "PerDay" not in json.dumps(details) and "PerMinute" not in json.dumps(details)
    assert details[2]["reason"] == "BUDGET_EXCEEDED"
    assert details[2]["metadata"] == {"code": "budget_exceeded", "rule": "b.yaml:8"}
    other = json.loads(answer(Refusal("model_not_allowed", "no"), shape="gemini").body)
    assert other["error"]["details"] == [{"reason": "model_not_allowed", "rule": None}]


def test_a_final_budget_refusal_on_a_websocket() -> None:
    from gateway.core.refusal import ws_error

    refusal = Refusal("budget_exceeded", "budget used up", "p.yaml:9", resets_in=7200)
    for session in ("responses_ws", "realtime"):
        event = json.loads(ws_error(refusal, session))
        assert event["error"]["type"] == event["error"]["code"] == "insufficient_quota"
        assert event["error"]["message"].startswith("budget_exceeded: budget used up (")
