"""Metering, model allowlists and budgets through the real gateway, with the official
`openai` and `anthropic` SDKs (and httpx for Gemini) configured only by environment,
against the local fake providers (tests/fakes/inference.py). Usage on audit lines,
in metrics and in `/v1/usage` must agree."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fakes.inference import FakeInference
from helpers.clock import far_window
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.metrics import metric

from gateway.services.policy import load_policy_texts
from gateway.services.policy.replay import replay

KEY = "sk-fake-provider-key"
POLICY = """
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
    models: ["gpt-4o-mini*", "text-embedding-3-small"]
  - host: api.anthropic.com
    credential: anthropic
  - host: generativelanguage.googleapis.com
    credential: gemini
budgets:
  - name: sandbox-daily
    per: sandbox
    window: {window}
    requests: {requests}
credentials:
  openai: {{preset: openai, secret: provider-key}}
  anthropic: {{preset: anthropic, secret: provider-key}}
  gemini: {{preset: gemini, secret: provider-key}}
"""
NAMES = ["api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com"]


def _gateway(make_gateway: GatewayFactory, tmp_path: Path, fake: FakeInference,
             requests: int = 100) -> GatewayThread:
    secrets = tmp_path / "s.yaml"
    secrets.write_text(f"provider-key: {KEY}\n")
    secrets.chmod(0o600)
    policy = POLICY.format(requests=requests, window=far_window())
    return make_gateway({"agent.yaml": policy}, config={
        "secrets": {"store": "file", "path": str(secrets)},
        "network": {"upstream_ca": str(fake.ca_path),
                    "resolve": {n: f"127.0.0.1:{fake.port}" for n in NAMES}}})


def _http(gw: GatewayThread, token: str) -> httpx.Client:
    return httpx.Client(proxy=gw.proxy_url(token), timeout=20,
                        verify=ssl.create_default_context(cafile=gw.ca_cert))


def _usage_lines(gw: GatewayThread) -> list[dict[str, Any]]:
    return [r for r in gw.audit.records() if r.get("usage")]


SDK_SCRIPT = r"""
import json, openai, anthropic, httpx, os
oai = openai.OpenAI(max_retries=0)
chat = oai.chat.completions.create(model="gpt-4o-mini",
                                   messages=[{"role": "user", "content": "say hi now"}])
stream = oai.chat.completions.create(model="gpt-4o-mini", stream=True,
                                     messages=[{"role": "user", "content": "count to three"}])
text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
claude = anthropic.Anthropic(max_retries=0)
msg = claude.messages.create(model="claude-sonnet-4-5", max_tokens=20,
                             messages=[{"role": "user", "content": "hello there"}])
with claude.messages.stream(model="claude-sonnet-4-5", max_tokens=20,
                            messages=[{"role": "user", "content": "stream it"}]) as s:
    streamed = "".join(s.text_stream)
gem = httpx.post("https://generativelanguage.googleapis.com/v1beta/models/"
                 "gemini-2.0-flash:generateContent",
                 headers={"x-goog-api-key": os.environ["GEMINI_API_KEY"]},
                 json={"contents": [{"parts": [{"text": "one two three"}]}]}, timeout=20)
print(json.dumps({"chat": chat.usage.completion_tokens, "stream": text,
                  "claude": msg.usage.output_tokens, "claude_stream": streamed,
                  "gemini": gem.status_code}))
"""


def test_sdks_streaming_and_not_are_metered(make_gateway: GatewayFactory, tmp_path: Path,
                                            fake: FakeInference) -> None:
    gw = _gateway(make_gateway, tmp_path, fake)
    token = gw.mint("agent")
    from gateway.tools.sandbox_env import sandbox_env

    # (metrics are per process: other tests in this process counted before)
    base_out = metric(gw, "sandbox_gateway_inference_tokens_total", kind="output",
                       policy="agent")
    base_in = metric(gw, "sandbox_gateway_inference_tokens_total", kind="input",
                      policy="agent")
    env = {k: v for k, v in os.environ.items() if "PROXY" not in k.upper()}
    for line in sandbox_env(token, gw.proxy, ca_bundle=str(gw.ca_cert)):
        key, _, value = line.partition("=")
        env[key] = value
    out = subprocess.run([sys.executable, "-c", SDK_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result == {"chat": 4, "stream": "The fake provider answers.", "claude": 4,
                      "claude_stream": "The fake provider answers.", "gemini": 200}
    # The gateway asked for usage on the OpenAI stream (the fake sends it only if asked).
    streamed = [json.loads(r.body) for r in fake.requests if b'"stream": true' in r.body
                or b'"stream":true' in r.body]
    assert any(r.get("stream_options") == {"include_usage": True} for r in streamed)
    lines = gw.audit.wait_for(lambda r: r.get("usage") is not None)
    time.sleep(0.3)
    lines = _usage_lines(gw)
    assert len(lines) == 5, [r["path"] for r in lines]
    assert [line["usage"]["output_tokens"] for line in lines] == [4, 4, 4, 4, 4]
    assert {line["usage"]["model"] for line in lines} == {
        "gpt-4o-mini-2025-01-01", "claude-sonnet-4-5", "gemini-2.0-flash-001"}
    # The key reached the fake; the token never did, and neither appears in the audit.
    assert all(token not in json.dumps(r.headers) for r in fake.requests)
    assert KEY not in gw.audit.getvalue() and token not in gw.audit.getvalue()
    # Metrics, /v1/usage and audit lines agree.
    out_audit = sum(line["usage"]["output_tokens"] for line in lines)
    in_audit = sum(line["usage"]["input_tokens"] for line in lines)
    assert metric(gw, "sandbox_gateway_inference_tokens_total", kind="output",
                   policy="agent") - base_out == out_audit
    assert metric(gw, "sandbox_gateway_inference_tokens_total", kind="input",
                   policy="agent") - base_in == in_audit
    usage = json.loads(urllib.request.urlopen(urllib.request.Request(
        gw.admin + "/v1/usage?sandbox=sandbox-1",
        headers={"Authorization": f"Bearer {gw.gateway.admin_token}"}), timeout=5).read())
    assert usage["totals"]["output_tokens"] == out_audit
    assert usage["totals"]["input_tokens"] == in_audit
    assert usage["totals"]["requests"] == 5


def test_model_outside_the_allowlist_is_refused_in_the_sdks_shape(
        make_gateway: GatewayFactory, tmp_path: Path, fake: FakeInference) -> None:
    gw = _gateway(make_gateway, tmp_path, fake)
    token = gw.mint("agent")
    oai = openai.OpenAI(api_key=token, http_client=_http(gw, token), max_retries=0)
    before = len(fake.requests)
    with pytest.raises(openai.PermissionDeniedError) as info:
        oai.chat.completions.create(model="gpt-5-pro",
                                    messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_allowed"
    assert "gpt-5-pro" in info.value.message and "gpt-4o-mini*" in info.value.message
    assert len(fake.requests) == before  # never reached the provider
    [line] = gw.audit.wait_for(lambda r: r["error"] == "model_not_allowed")
    assert line["decision"] == "deny" and line["status"] == 403


def test_replay_decides_the_recorded_models_again(make_gateway: GatewayFactory,
                                                 tmp_path: Path, fake: FakeInference) -> None:
    """The audit line names every model a call reached (`models`, on a rule with an
    allowlist), allowed or refused, and `policy diff --replay` decides them again
    (issue 41.3): a fallback model a narrowed allowlist no longer covers is newly
    denied, a model a widened one covers newly allowed."""
    gw = _gateway(make_gateway, tmp_path, fake)
    token = gw.mint("agent")
    oai = openai.OpenAI(api_key=token, http_client=_http(gw, token), max_retries=0)
    oai.chat.completions.create(model="gpt-4o-mini", extra_body={
        "models": ["gpt-4o-mini-2024-07-18"]}, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.PermissionDeniedError):
        oai.chat.completions.create(model="gpt-5-pro",
                                    messages=[{"role": "user", "content": "hi"}])
    gw.audit.wait_for(lambda r: r["error"] == "model_not_allowed")
    lines = [r for r in gw.audit.records() if r.get("models") is not None]
    assert [r["models"] for r in lines] == [["gpt-4o-mini", "gpt-4o-mini-2024-07-18"],
                                           ["gpt-5-pro"]], lines
    policy = POLICY.format(requests=100, window=far_window())
    base = load_policy_texts({"policies/agent.yaml": policy})
    for models, category, line in (('["gpt-4o-mini", "text-embedding-3-small"]',
                                    "newly_denied", lines[0]),
                                   ('["gpt-4o-mini*", "gpt-5*"]', "newly_allowed", lines[1])):
        head = policy.replace('["gpt-4o-mini*", "text-embedding-3-small"]', models)
        report = replay([json.dumps(r) for r in lines], base,
                        load_policy_texts({"policies/agent.yaml": head}))
        [group] = report.groups(category)
        assert group.count == 1 and not report.groups(
            "newly_allowed" if category == "newly_denied" else "newly_denied")
        assert group.examples[0].model == line["models"][0], report.to_dict()


def test_a_realtime_session_for_another_model_is_refused(make_gateway: GatewayFactory,
                                                          tmp_path: Path,
                                                          fake: FakeInference) -> None:
    """The Realtime API opens a WebSocket with the model in the query: the allowlist
    checks it before the upgrade reaches the provider (plain GETs alike)."""
    gw = _gateway(make_gateway, tmp_path, fake)
    token = gw.mint("agent")
    before = len(fake.requests)
    upgrade = {"Authorization": f"Bearer {token}", "Connection": "Upgrade",
               "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
    with _http(gw, token) as http:
        for headers in (upgrade, {"Authorization": f"Bearer {token}"}):
            r = http.get("https://api.openai.com/v1/realtime?model=gpt-4o-realtime-preview",
                         headers=headers)
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "model_not_allowed"
            assert "gpt-4o-realtime-preview" in r.json()["error"]["message"]
    assert len(fake.requests) == before  # never reached the provider
    lines = gw.audit.wait_for(lambda r: r["error"] == "model_not_allowed")
    assert len(lines) == 2 and all(line["path"] == "/v1/realtime" for line in lines)


def test_a_stream_that_declines_usage_is_still_metered(make_gateway: GatewayFactory,
                                                        tmp_path: Path,
                                                        fake: FakeInference) -> None:
    """`include_usage: false` would stream tokens past token budgets: the gateway sets it
    (the fake sends usage only when asked), and the agent's chunks arrive as before."""
    gw = _gateway(make_gateway, tmp_path, fake)
    token = gw.mint("agent")
    oai = openai.OpenAI(api_key=token, http_client=_http(gw, token), max_retries=0)
    stream = oai.chat.completions.create(
        model="gpt-4o-mini", stream=True, stream_options={"include_usage": False},
        messages=[{"role": "user", "content": "count"}])
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "The fake provider answers."
    sent = json.loads(fake.requests[-1].body)
    assert sent["stream_options"] == {"include_usage": True}
    [line] = gw.audit.wait_for(lambda r: r.get("usage") is not None)
    assert line["usage"]["output_tokens"] == 4 and line["usage"]["input_tokens"] > 0


def test_a_used_up_budget_stops_the_sdks_at_once(make_gateway: GatewayFactory,
                                                 tmp_path: Path, fake: FakeInference) -> None:
    """A budget used up until its window ends (hours away) is final: the official SDKs,
    with their default retries (2), raise on the first answer instead of waiting out a
    Retry-After: OpenAI's quota error (429 insufficient_quota), Anthropic's spent-credit
    answer (400 invalid_request_error). One refused request each reaches the gateway;
    the gateway's own code is in the message, the header and the audit line."""
    import anthropic
    import httpx2

    gw = _gateway(make_gateway, tmp_path, fake, requests=2)
    token = gw.mint("agent")
    oai = openai.OpenAI(api_key=token, http_client=_http(gw, token))  # max_retries=2
    for _ in range(2):  # the request that reaches the limit completes
        oai.chat.completions.create(model="gpt-4o-mini",
                                    messages=[{"role": "user", "content": "hi"}])
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as info:
        oai.chat.completions.create(model="gpt-4o-mini",
                                    messages=[{"role": "user", "content": "hi"}])
    assert (info.value.code, info.value.type) == ("insufficient_quota", "insufficient_quota")
    assert 'budget_exceeded: budget "sandbox-daily"' in info.value.message
    headers = info.value.response.headers
    assert "retry-after" not in headers and headers["x-should-retry"] == "false"
    assert headers["x-sandbox-gateway-error"] == "budget_exceeded"
    with anthropic.Anthropic(api_key=token, http_client=httpx2.Client(
            proxy=gw.proxy_url(token), timeout=20,
            verify=ssl.create_default_context(cafile=gw.ca_cert))) as claude, \
            pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model="claude-haiku-5", max_tokens=20,
                               messages=[{"role": "user", "content": "hi"}])
    error = refused.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error" and error["code"] == "budget_exceeded"
    assert 'budget_exceeded: budget "sandbox-daily"' in error["message"]
    assert time.monotonic() - started < 5  # (no backoff, no Retry-After waited out)
    lines = gw.audit.wait_for(lambda r: r.get("error") == "budget_exceeded")
    assert [(r["host"], r["status"]) for r in lines] == [("api.openai.com", 429),
                                                         ("api.anthropic.com", 400)]
    assert 'budget "sandbox-daily"' in lines[0]["reason"]
    assert len(fake.requests) == 2


STREAM = {"model": "gpt-4o-mini", "stream": True,
          "messages": [{"role": "user", "content": "count slowly"}]}


async def _burst(proxy: str, cafile: str, n: int) -> list[int]:
    """`n` streamed chat completions in parallel; their statuses."""
    import asyncio

    token = proxy.split(":")[2].split("@")[0]
    async with httpx.AsyncClient(proxy=proxy, timeout=30, limits=httpx.Limits(
            max_connections=n), verify=ssl.create_default_context(cafile=cafile)) as http:
        async def one() -> int:
            async with http.stream("POST", "https://api.openai.com/v1/chat/completions",
                                   headers={"Authorization": f"Bearer {token}"},
                                   json=STREAM) as r:
                await r.aread()
                return r.status_code
        return list(await asyncio.gather(*(one() for _ in range(n))))


def test_a_parallel_burst_meets_the_requests_limit(make_gateway: GatewayFactory,
                                                   tmp_path: Path,
                                                   fake: FakeInference) -> None:
    """Requests count when admitted: ten parallel streamed calls (each lasting about a
    second) against a 4-request budget; four reach the provider, six get 429."""
    import asyncio

    fake.interval = 0.2
    gw = _gateway(make_gateway, tmp_path, fake, requests=4)
    token = gw.mint("agent")
    statuses = asyncio.run(_burst(gw.proxy_url(token), str(gw.ca_cert), 10))
    assert sorted(statuses) == [200] * 4 + [429] * 6, statuses
    assert len([r for r in fake.requests if r.path == "/v1/chat/completions"]) == 4


def test_two_gateway_processes_sharing_redis_enforce_one_budget(
        tmp_path: Path, fake: FakeInference, test_ca: Any) -> None:
    """Two `sandbox-gateway run` processes (two replicas) and one real redis-server:
    one sandbox budget of 4 requests, exact whichever replica serves the calls (budget
    admission is one Redis script). Measured before: one call too many per replica."""
    import asyncio

    from helpers.process import start_gateway
    from helpers.redis_server import RedisServer

    redis = RedisServer(tmp_path / "redis")
    redis.start()
    gws = []
    try:
        secrets = tmp_path / "s.yaml"
        secrets.write_text(f"provider-key: {KEY}\n")
        secrets.chmod(0o600)
        extra = {"secrets": {"store": "file", "path": str(secrets)},
                 "state": {"store": "redis", "url": redis.url},
                 "certs": str(tmp_path / "certs"),  # one CA and signing key for both
                 "network": {"upstream_ca": str(fake.ca_path)}}
        for i in range(2):
            gws.append(start_gateway(tmp_path / f"gw{i}", {n: fake.port for n in NAMES},
                                     test_ca, policy=POLICY.format(requests=4, window="24h"),
                                     extra=extra))
        cafile = str(tmp_path / "certs" / "ca.crt")

        def proxy(gw: Any, sandbox: str, token: str) -> str:
            return f"http://{sandbox}:{token}@127.0.0.1:{gw.proxy}"

        # Alternating replicas, one call at a time: 4 served, then 429 on both.
        token = gws[0].token("sbx-a")
        answers = []
        for i in range(8):
            with httpx.Client(proxy=proxy(gws[i % 2], "sbx-a", token), timeout=20,
                              verify=ssl.create_default_context(cafile=cafile)) as http:
                r = http.post("https://api.openai.com/v1/chat/completions",
                              headers={"Authorization": f"Bearer {token}"},
                              json={"model": "gpt-4o-mini",
                                    "messages": [{"role": "user", "content": "hi"}]})
            answers.append(r.status_code)
        assert answers == [200] * 4 + [429] * 4, answers
        # Parallel bursts on both replicas at once meet the limit exactly, the other
        # replica never having seen this sandbox before.
        fake.interval = 0.2
        token = gws[0].token("sbx-b")

        async def both() -> list[int]:
            bursts = await asyncio.gather(_burst(proxy(gws[0], "sbx-b", token), cafile, 5),
                                          _burst(proxy(gws[1], "sbx-b", token), cafile, 5))
            return [status for burst in bursts for status in burst]

        burst = asyncio.run(both())
        assert sorted(burst) == [200] * 4 + [429] * 6, burst
        assert len([r for r in fake.requests if r.path == "/v1/chat/completions"]) == 8
        # Each replica's audit lines name what it served and refused (a line is written
        # when its connection ends, just after the client has its answer).
        def outcomes() -> tuple[int, int]:
            lines = [line for gw in gws for line in gw.audit_lines()
                     if line.get("path") == "/v1/chat/completions"]
            return (sum(1 for line in lines if line["status"] == 200),
                    sum(1 for line in lines if line["error"] == "budget_exceeded"))

        deadline = time.monotonic() + 5
        while outcomes() != (8, 10) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert outcomes() == (8, 10)
    finally:
        for gw in gws:
            gw.stop()
        redis.stop()
