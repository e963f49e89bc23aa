"""Metering fails closed, through the real gateway, with the official SDKs against the
fake providers (tests/fakes): every way around budgets and allowlists found on the
previous `main` (the metering issue's "Why", numbered the same) is a case here.

Two policies: `agent` has a 10,000-token daily budget (so its calls must be metered);
`free` has none, allows provider-minted secrets, and meters deferred jobs when their
results are retrieved."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
import websockets.asyncio.client
import websockets.exceptions
from fakes.inference import FakeInference
from fakes.realtime import FakeRealtime
from helpers.gateway import GatewayFactory, GatewayThread

from gateway.core.leak_forms import canonical, sensitive_markers
from gateway.observability.logs import REDACTED, REDACTION
from gateway.tools.sandbox_env import sandbox_env

KEY = "sk-fake-provider-key"
NAMES = ["api.openai.com", "api.anthropic.com", "myaccount.openai.azure.com"]
WS_HOST = "ws.openai.test"  # the WebSocket fake (another port), a host of the same key
POLICIES = {
    "agent.yaml": """
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
    models: ["gpt-4o-mini*", "gpt-realtime*"]
  - host: ws.openai.test
    credential: openai
    models: ["gpt-4o-mini*", "gpt-realtime*"]
  - host: api.anthropic.com
    credential: anthropic
  - host: myaccount.openai.azure.com
    credential: azure
  - host: other.test
    inspect: true
budgets:
  - {name: daily, per: sandbox, window: 24h, tokens: 10000}
""",
    "free.yaml": """
version: v1
name: free
egress:
  - host: api.openai.com
    credential: openai
    allow_minted_secrets: true
  - host: ws.openai.test
    credential: openai
    allow_minted_secrets: true
  - host: api.anthropic.com
    credential: anthropic
  - host: other.test
    inspect: true
credentials:
  openai: {preset: openai, secret: provider-key, hosts: [api.openai.com, ws.openai.test]}
  anthropic: {preset: anthropic, secret: provider-key}
  azure: {preset: azure-openai, secret: provider-key, hosts: [myaccount.openai.azure.com]}
""",
}


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeInference]:
    with FakeInference(tmp_path / "fake", api_key=KEY, output_tokens=6000,
                       background_after=2) as server:
        yield server


@pytest.fixture
def ws(fake: FakeInference, tmp_path: Path) -> Iterator[FakeRealtime]:
    server = FakeRealtime(tmp_path / "ws", fake.ca, [WS_HOST], inference=fake)
    yield server
    server.stop()


@pytest.fixture(params=["fast", "mitmproxy"])
def gw(request: pytest.FixtureRequest, make_gateway: GatewayFactory, tmp_path: Path,
       fake: FakeInference, ws: FakeRealtime) -> GatewayThread:
    secrets = tmp_path / "s.yaml"
    secrets.write_text(f"provider-key: {KEY}\n")
    secrets.chmod(0o600)
    resolve = {n: f"127.0.0.1:{fake.port}" for n in [*NAMES, "other.test"]}
    resolve[WS_HOST] = f"127.0.0.1:{ws.port}"
    return make_gateway(POLICIES, config={
        "secrets": {"store": "file", "path": str(secrets)},
        "network": {"intercept": request.param, "upstream_ca": str(fake.ca_path),
                    "resolve": resolve}})


def _http(gw: GatewayThread, token: str, sandbox: str = "sandbox-1") -> httpx.Client:
    return httpx.Client(proxy=gw.proxy_url(token, sandbox), timeout=30,
                        verify=ssl.create_default_context(cafile=gw.ca_cert))


def _oai(gw: GatewayThread, token: str, sandbox: str = "sandbox-1") -> openai.OpenAI:
    return openai.OpenAI(api_key=token, http_client=_http(gw, token, sandbox), max_retries=0)


def _usage(gw: GatewayThread, sandbox: str = "sandbox-1") -> dict[str, Any]:
    answer: dict[str, Any] = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"{gw.admin}/v1/usage?sandbox={sandbox}",
        headers={"Authorization": f"Bearer {gw.gateway.admin_token}"}), timeout=5).read())
    return answer


def _lines(gw: GatewayThread, count: int, **match: Any) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 5
    while True:
        found = [r for r in gw.audit.records()
                 if all(r.get(k) == v for k, v in match.items())]
        if len(found) >= count or time.monotonic() > deadline:
            assert len(found) == count, (match, found)
            return found
        time.sleep(0.05)


def _stream(http: httpx.Client, path: str, body: bytes, headers: dict[str, str]
            ) -> httpx.Response:
    return http.post(f"https://api.openai.com{path}", content=body, headers={
        "Content-Type": "application/json", **headers})


# 1. Another spelling of the endpoint: four 6,000-token streams passed a 10,000-token budget.
def test_another_spelling_cannot_stream_past_a_token_budget(gw: GatewayThread,
                                                             fake: FakeInference) -> None:
    token = gw.mint("agent")
    auth = {"Authorization": f"Bearer {token}"}
    body = json.dumps({"model": "gpt-4o-mini", "stream": True, "max_tokens": 6000,
                       "messages": [{"role": "user", "content": "write a lot"}]}).encode()
    answers = []
    with _http(gw, token) as http:
        for path in ("/v1/chat/completion%73", "//v1/chat/completions/",
                     "/v1/chat/completions", "/v1/chat/completion%73"):
            answers.append(_stream(http, path, body, auth))
    assert [a.status_code for a in answers] == [200, 429, 429, 429], answers[1].text
    # The spelled call asked for its usage, and its usage was counted.
    asked = [r.json() for r in fake.requests if r.path.startswith("//v1/chat/completion")
             or "completion%73" in r.path]
    assert asked and asked[0]["stream_options"] == {"include_usage": True}
    refused = answers[1].json()["error"]  # (a quota answer: type and code insufficient_quota
    # unless the daily window ends within RETRY_AFTER_MAX; the gateway's code either way)
    assert refused["message"].startswith('budget_exceeded: budget "daily"'), refused
    assert answers[1].headers["X-Sandbox-Gateway-Error"] == "budget_exceeded"
    used = _usage(gw)
    assert used["totals"]["output_tokens"] == 6000
    [budget] = used["budgets"]
    assert budget["settled"]["tokens"] >= 6000 and budget["reserved"]["tokens"] == 0


# 2. Bodies the meter did not read: padded past the old hold size, or gzip-encoded.
@pytest.mark.parametrize("shape", ["padded", "gzip"])
def test_padded_and_compressed_bodies_are_read(gw: GatewayThread, fake: FakeInference,
                                               shape: str) -> None:
    token = gw.mint("agent")
    doc = {"model": "gpt-4o-mini", "stream": True, "max_tokens": 6000,
           "messages": [{"role": "user", "content": "hi"}]}
    raw = json.dumps(doc).encode()
    headers = {"Authorization": f"Bearer {token}"}
    if shape == "padded":
        raw = raw[:-1] + b"\n" + b" " * (3 << 20) + b"}"  # 3 MiB of layout whitespace
    else:
        raw, headers["Content-Encoding"] = gzip.compress(raw), "gzip"
    with _http(gw, token) as http:
        first = _stream(http, "/v1/chat/completions", raw, headers)
        second = _stream(http, "/v1/chat/completions", raw, headers)
    assert (first.status_code, second.status_code) == (200, 429), first.text
    seen = fake.requests[-1]
    assert json.loads(seen.decoded or b"")["stream_options"] == {"include_usage": True}
    if shape == "gzip":  # re-encoded in the coding its head names
        assert seen.headers["content-encoding"] == "gzip" and seen.body[:2] == b"\x1f\x8b"
    [line] = _lines(gw, 1, path="/v1/chat/completions", decision="allow")
    assert line["usage"]["output_tokens"] == 6000
    assert line["usage"]["budget"]["basis"] == "usage"


# 6. JSON a provider may read differently; an Azure api-version without stream usage.
def test_json_the_provider_may_read_differently_is_refused(gw: GatewayThread,
                                                           fake: FakeInference) -> None:
    token = gw.mint("agent")
    before = len(fake.requests)
    with _http(gw, token) as http:
        twice = http.post("https://api.openai.com/v1/chat/completions",
                          content=b'{"model": "gpt-4o-mini", "Model": "gpt-4o", '
                                  b'"messages": []}',
                          headers={"Authorization": f"Bearer {token}",
                                   "Content-Type": "application/json"})
    assert twice.status_code == 403 and twice.json()["error"]["code"] == "model_not_allowed"
    with openai.AzureOpenAI(api_key=token, api_version="2024-06-01", max_retries=0,
                            azure_endpoint="https://myaccount.openai.azure.com",
                            http_client=_http(gw, token)) as azure, \
            pytest.raises(openai.PermissionDeniedError) as refused:
        azure.chat.completions.create(model="gpt-4o", stream=True,
                                      messages=[{"role": "user", "content": "hi"}])
    assert refused.value.code == "metering_unavailable"
    assert "api-version 2024-06-01 cannot report its usage" in refused.value.message
    assert len(fake.requests) == before


# 4. Background work and batches: refused where budgets apply, metered once when
#    retrieved elsewhere.
def test_deferred_work(gw: GatewayThread, fake: FakeInference) -> None:
    before = len(fake.requests)
    with _oai(gw, gw.mint("agent")) as budgeted:
        with pytest.raises(openai.PermissionDeniedError) as refused:
            budgeted.responses.create(model="gpt-4o-mini", input="later", background=True)
        assert refused.value.code == "metering_unavailable"
        assert "a background response" in refused.value.message
        with pytest.raises(openai.PermissionDeniedError):
            budgeted.batches.create(input_file_id="file-x", endpoint="/v1/chat/completions",
                                    completion_window="24h")
    token = gw.mint("agent")
    with anthropic.Anthropic(api_key=token, max_retries=0, http_client=httpx2.Client(
            proxy=gw.proxy_url(token), timeout=30,
            verify=ssl.create_default_context(cafile=gw.ca_cert))) as claude, \
            pytest.raises(anthropic.PermissionDeniedError):
        claude.messages.batches.create(requests=[{"custom_id": "a", "params": {
            "model": "claude-x", "max_tokens": 10,
            "messages": [{"role": "user", "content": "hi"}]}}])
    assert len(fake.requests) == before  # none reached the provider

    with _oai(gw, gw.mint("free", sandbox="sandbox-2"), "sandbox-2") as free:
        job = free.responses.create(model="gpt-4o-mini", input="later please",
                                    background=True)
        assert job.status == "queued" and job.usage is None
        assert free.responses.retrieve(job.id).status == "in_progress"
        done = free.responses.retrieve(job.id)
        assert done.status == "completed" and done.usage is not None
        again = free.responses.retrieve(job.id)  # metered once, not per retrieval
        assert again.usage is not None
    used = _usage(gw, "sandbox-2")["totals"]
    assert used["output_tokens"] == done.usage.output_tokens == 6000
    assert used["requests"] == 1
    metered = [r for r in _lines(gw, 3, path=f"/v1/responses/{job.id}") if r["usage"]]
    assert len(metered) == 1 and metered[0]["policy"] == "free"
    assert (metered[0]["usage"]["output_tokens"], metered[0]["usage"]["input_tokens"]) == (
        6000, done.usage.input_tokens)


# 3. The Responses API over WebSocket: allowlist, usage and budget on every response.create.
SESSION = r"""
import json, sys, openai
client = openai.OpenAI(max_retries=0, websocket_base_url="wss://ws.openai.test/v1")
out = []
with client.responses.connect() as conn:
    for model in sys.argv[1:]:
        conn.response.create(model=model, input="hello there", max_output_tokens=6000)
        for event in conn:
            if event.type in ("response.completed", "response.incomplete", "error"):
                out.append({"type": event.type,
                            "code": getattr(getattr(event, "error", None), "code", None),
                            "message": getattr(getattr(event, "error", None), "message", None),
                            "usage": event.response.usage.output_tokens
                            if event.type != "error" else None})
                break
print(json.dumps(out))
"""


def _sdk(gw: GatewayThread, token: str, script: str, *args: str) -> Any:
    env = {k: v for k, v in os.environ.items() if "PROXY" not in k.upper()}
    for line in sandbox_env(token, gw.proxy, ca_bundle=str(gw.ca_cert)):
        key, _, value = line.partition("=")
        env[key] = value
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_responses_over_websocket(gw: GatewayThread, ws: FakeRealtime) -> None:
    """(The SDK's connect() is websockets' sync client, which reads and writes one
    SSLSocket from two threads: a TLS 1.3 session ticket arriving as it writes can hang
    it. Both engines hold their tickets until their first answer, so it runs on both.)"""
    token = gw.mint("agent")
    events = _sdk(gw, token, SESSION, "gpt-4o", "gpt-4o-mini", "gpt-4o-mini")
    # (the gateway's code opens each message; a used-up budget's event carries OpenAI's
    # insufficient_quota code unless its window ends within RETRY_AFTER_MAX)
    assert [(e["type"], (e["message"] or "").partition(":")[0] or None) for e in events] == [
        ("error", "model_not_allowed"), ("response.completed", None),
        ("error", "budget_exceeded")]
    assert events[0]["code"] == "model_not_allowed"
    assert "gpt-4o" in events[0]["message"] and 'budget "daily"' in events[2]["message"]
    assert events[1]["usage"] == 6000
    [connection] = ws.connections
    assert [e["model"] for e in connection.received] == ["gpt-4o-mini"]  # only the allowed
    assert connection.headers["authorization"] == f"Bearer {KEY}"
    lines = _lines(gw, 3, path="/v1/responses")
    assert [(line["decision"], line["error"]) for line in lines] == [
        ("deny", "model_not_allowed"), ("deny", "budget_exceeded"), ("allow", None)]
    assert lines[-1]["status"] == 101 and lines[-1]["usage"]["output_tokens"] == 6000
    assert _usage(gw)["totals"]["output_tokens"] == 6000


# 5. Secrets the provider mints: refused by default; allowed, the sandbox gets an alias.
def _received(answer: httpx.Response) -> bytes:
    """All a client received: the status line, the header fields, the body."""
    fields = b"".join(k + b": " + v + b"\n" for k, v in answer.headers.raw)
    return f"{answer.status_code} {answer.reason_phrase}\n".encode() + fields + answer.content


def _carries(data: bytes, secret: str) -> bool:
    """`secret` in `data` in any encoding the leak scan knows (raw, base64, hex, %-,
    JSON-escaped, any case)."""
    text = canonical(data)
    return any(marker in text for marker in sensitive_markers(secret.encode()))


async def _realtime(gw: GatewayThread, token: str, sandbox: str,
                    **connect: Any) -> list[str]:
    """One Realtime session through the gateway (the asyncio client: one thread per TLS
    session): session.created, a response; the server events' types."""
    seen: list[str] = []
    async with websockets.asyncio.client.connect(
            f"wss://{WS_HOST}/v1/realtime?model=gpt-realtime", open_timeout=10,
            proxy=gw.proxy_url(token, sandbox),
            ssl=ssl.create_default_context(cafile=gw.ca_cert), **connect) as conn:
        seen.append(json.loads(await conn.recv())["type"])
        await conn.send(json.dumps({"type": "response.create"}))
        while seen[-1] != "response.done":
            seen.append(json.loads(await asyncio.wait_for(conn.recv(), 10))["type"])
    return seen


def test_provider_minted_secrets(gw: GatewayThread, fake: FakeInference,
                                 ws: FakeRealtime) -> None:
    session = {"type": "realtime", "model": "gpt-realtime"}
    with _oai(gw, gw.mint("agent")) as budgeted, \
            pytest.raises(openai.PermissionDeniedError) as refused:
        budgeted.realtime.client_secrets.create(session=session)  # type: ignore[arg-type]
    assert refused.value.code == "minted_secret_refused"
    assert "allow_minted_secrets: true" in refused.value.message
    assert fake.minted == []

    # Allowed: the sandbox receives an alias of the secret's shape, never the secret.
    token = gw.mint("free", sandbox="sandbox-2")
    with _oai(gw, token, "sandbox-2") as client:
        raw = client.realtime.client_secrets.with_raw_response.create(
            session=session)  # type: ignore[arg-type]
        alias = raw.parse().value
    [secret] = fake.minted
    assert alias != secret and alias.startswith("ek_") and len(alias) == len(secret)
    assert not _carries(_received(raw.http_response), secret)
    with _http(gw, token, "sandbox-2") as http:  # the older sessions' shape
        older = http.post("https://api.openai.com/v1/realtime/sessions",
                          json={"model": "gpt-4o-realtime-preview"},
                          headers={"Authorization": f"Bearer {token}"})
    assert older.status_code == 200, older.text
    older_alias, older_secret = older.json()["client_secret"]["value"], fake.minted[-1]
    assert older_alias != older_secret and not _carries(_received(older), older_secret)

    # The alias back to the credential's hosts from this sandbox: the provider gets the
    # secret in its place, and the call is metered on the same rule.
    with openai.OpenAI(api_key=older_alias, http_client=_http(gw, token, "sandbox-2"),
                       max_retries=0) as aliased:
        answer = aliased.responses.create(model="gpt-4o-mini", input="hello")
    assert answer.usage is not None
    assert fake.requests[-1].headers["authorization"] == f"Bearer {older_secret}"
    assert asyncio.run(_realtime(gw, token, "sandbox-2", additional_headers={
        "Authorization": f"Bearer {alias}"}))[-1] == "response.done"
    assert ws.upgrades[-1]["authorization"] == f"Bearer {secret}"
    # (a browser's way: the key as a WebSocket subprotocol)
    asyncio.run(_realtime(gw, token, "sandbox-2", subprotocols=[
        "realtime", f"openai-insecure-api-key.{alias}"]))
    offered = ws.upgrades[-1]["sec-websocket-protocol"]
    assert f"openai-insecure-api-key.{secret}" in offered and alias not in offered
    lines = _lines(gw, 2, path="/v1/realtime", decision="allow")
    assert all(line["credential"] == "openai" and line["usage"]["output_tokens"] == 20
               for line in lines)
    [line] = _lines(gw, 1, path="/v1/responses", decision="allow", sandbox="sandbox-2")
    assert line["usage"]["output_tokens"] == answer.usage.output_tokens

    # Anywhere else the alias is refused like a token: another allowed host, in clear
    # or encoded, or a body to its own host.
    with _http(gw, token, "sandbox-2") as http:
        for host, body in [("other.test", json.dumps({"s": alias})),
                           ("other.test", base64.b64encode(alias.encode()).decode()),
                           ("api.openai.com", json.dumps({"input": alias}))]:
            leaked = http.post(f"https://{host}/v1/responses", content=body,
                               headers={"Authorization": f"Bearer {token}"})
            assert leaked.status_code == 403, (host, leaked.text)
            assert "exfiltration_blocked" in leaked.text
    # Another sandbox cannot use it, over HTTP or WebSocket.
    other = gw.mint("free", sandbox="sandbox-3")
    with openai.OpenAI(api_key=older_alias, http_client=_http(gw, other, "sandbox-3"),
                       max_retries=0) as stranger, \
            pytest.raises(openai.PermissionDeniedError) as refused:
        stranger.responses.create(model="gpt-4o-mini", input="hello")
    assert "exfiltration_blocked" in str(refused.value.body)
    with pytest.raises(websockets.exceptions.InvalidStatus) as refused_upgrade:
        asyncio.run(_realtime(gw, other, "sandbox-3", additional_headers={
            "Authorization": f"Bearer {alias}"}))
    assert refused_upgrade.value.response.status_code == 403
    assert len(ws.upgrades) == 2 and fake.requests[-1].headers["authorization"] == \
        f"Bearer {older_secret}"  # (nothing more reached the providers)
    # Neither the secrets nor the aliases are on the audit trail, or in a log line.
    trail = gw.audit.getvalue()
    assert not any(v in trail for v in (secret, alias, older_secret, older_alias))
    for value in (secret, alias, older_secret, older_alias):
        assert REDACTION.redact(f"x {value} y") == f"x {REDACTED} y"


def test_policy_test_decides_like_the_gateway(gw: GatewayThread, tmp_path: Path,
                                              fake: FakeInference) -> None:
    """8. `policy test` once said model allowlists "do not exist yet": the same cases
    through `policy test` and through the gateway give the same answers."""
    from gateway.cli import main

    pdir = tmp_path / "policies"
    (pdir / "tests").mkdir(parents=True, exist_ok=True)
    for name, text in POLICIES.items():
        (pdir / name).write_text(text)
    cases = [
        ("agent", "POST", "/v1/chat/completions", {"model": "gpt-4o-mini", "max_tokens": 5,
                                                   "messages": []}, "allow", None),
        ("agent", "POST", "/v1/chat/completions", {"model": "gpt-4o", "messages": []},
         "deny", "model_not_allowed"),
        ("agent", "POST", "/v1/responses", {"model": "gpt-4o-mini", "background": True},
         "deny", "metering_unavailable"),
        ("agent", "POST", "/v1/chat/completions", {"model": "gpt-4o-mini",
                                                   "max_tokens": 20000}, "deny",
         "budget_exceeded"),
        ("agent", "POST", "/v1/realtime/client_secrets", {"session": {
            "model": "gpt-realtime"}}, "deny", "minted_secret_refused"),
    ]
    (pdir / "tests" / "t.yaml").write_text(json.dumps({"cases": [
        {"name": f"case {i}", "policy": pol, "method": method,
         "url": f"https://api.openai.com{path}", "body": body, "expect": expect,
         **({"error": error} if error else {})}
        for i, (pol, method, path, body, expect, error) in enumerate(cases)]}))
    assert main(["policy", "test", str(pdir)]) == 0
    token = gw.mint("agent")
    with _http(gw, token) as http:
        for _pol, method, path, body, expect, error in cases:
            answer = http.request(method, f"https://api.openai.com{path}",
                                  content=json.dumps(body),
                                  headers={"Authorization": f"Bearer {token}",
                                           "Content-Type": "application/json"})
            got = answer.headers.get("X-Sandbox-Gateway-Error")  # (the gateway's code)
            assert (got, expect == "allow") == (error, answer.status_code < 400), answer.text


# 9. A fallback list (issue 39): an allowed model first, the others after it; OpenRouter
# and LiteLLM send the call on to them when the first fails. Every one is checked.
@pytest.mark.parametrize(("extra", "outside"), [
    ({"models": ["gpt-4o-mini", "forbidden-x"], "route": "fallback"}, "forbidden-x"),
    ({"fallbacks": [{"model": "claude-x", "messages": []}]}, "claude-x"),
    ({"extra_body": {"models": ["gpt-4o"]}}, "gpt-4o"),
    ({"models": ["gpt-4o-mini-2024-07-18"], "route": "fallback"}, None),
])
def test_every_model_a_call_can_fall_back_to_is_checked(gw: GatewayThread,
                                                       fake: FakeInference,
                                                       extra: dict[str, Any],
                                                       outside: str | None) -> None:
    token = gw.mint("agent")
    before = len(fake.requests)
    with _oai(gw, token) as oai:
        if outside is None:
            oai.chat.completions.create(model="gpt-4o-mini", max_tokens=10, extra_body=extra,
                                        messages=[{"role": "user", "content": "hi"}])
            sent = json.loads(fake.requests[-1].body)
            assert {k: sent[k] for k in extra} == extra  # (forwarded as the sandbox sent it)
            return
        with pytest.raises(openai.PermissionDeniedError) as refused:
            oai.chat.completions.create(model="gpt-4o-mini", max_tokens=10, extra_body=extra,
                                        messages=[{"role": "user", "content": "hi"}])
    assert refused.value.code == "model_not_allowed"
    assert f'model "{outside}" (in "' in refused.value.message
    assert "is not allowed by rule policies/agent.yaml:" in refused.value.message
    assert len(fake.requests) == before  # nothing reached the provider
    [line] = _lines(gw, 1, error="model_not_allowed")
    assert f'model "{outside}"' in line["reason"]
