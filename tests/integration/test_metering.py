"""Metering, model allowlists and budgets through the real gateway, with the official
`openai` and `anthropic` SDKs (and httpx for Gemini) configured only by environment,
against the local fake providers (tests/fakes/inference.py). Usage on audit lines,
in metrics and in `/v1/usage` must agree."""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fakes.inference import FakeInference
from helpers.gateway import GatewayFactory, GatewayThread

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
    window: 24h
    requests: {requests}
credentials:
  openai: {{preset: openai, secret: provider-key}}
  anthropic: {{preset: anthropic, secret: provider-key}}
  gemini: {{preset: gemini, secret: provider-key}}
"""
NAMES = ["api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com"]


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeInference]:
    with FakeInference(tmp_path / "fake", api_key=KEY) as server:
        yield server


def _gateway(make_gateway: GatewayFactory, tmp_path: Path, fake: FakeInference,
             requests: int = 100) -> GatewayThread:
    secrets = tmp_path / "s.yaml"
    secrets.write_text(f"provider-key: {KEY}\n")
    secrets.chmod(0o600)
    return make_gateway({"agent.yaml": POLICY.format(requests=requests)}, config={
        "secrets": {"store": "file", "path": str(secrets)},
        "network": {"upstream_ca": str(fake.ca_path),
                    "resolve": {n: f"127.0.0.1:{fake.port}" for n in NAMES}}})


def _http(gw: GatewayThread, token: str) -> httpx.Client:
    return httpx.Client(proxy=gw.proxy_url(token), timeout=20,
                        verify=ssl.create_default_context(cafile=gw.ca_cert))


def _usage_lines(gw: GatewayThread) -> list[dict[str, Any]]:
    return [r for r in gw.audit.records() if r.get("usage")]


def _metric(gw: GatewayThread, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(gw.admin + "/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


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
    from gateway.sandbox_env import sandbox_env

    # (metrics are per process: other tests in this process counted before)
    base_out = _metric(gw, "sandbox_gateway_inference_tokens_total", kind="output",
                       policy="agent")
    base_in = _metric(gw, "sandbox_gateway_inference_tokens_total", kind="input",
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
    assert _metric(gw, "sandbox_gateway_inference_tokens_total", kind="output",
                   policy="agent") - base_out == out_audit
    assert _metric(gw, "sandbox_gateway_inference_tokens_total", kind="input",
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


def test_budget_exhaustion_is_429_with_retry_after(make_gateway: GatewayFactory,
                                                   tmp_path: Path,
                                                   fake: FakeInference) -> None:
    gw = _gateway(make_gateway, tmp_path, fake, requests=2)
    token = gw.mint("agent")
    oai = openai.OpenAI(api_key=token, http_client=_http(gw, token), max_retries=0)
    for _ in range(2):  # the request that reaches the limit completes
        oai.chat.completions.create(model="gpt-4o-mini",
                                    messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.RateLimitError) as info:
        oai.chat.completions.create(model="gpt-4o-mini",
                                    messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "budget_exceeded"
    assert "sandbox-daily" in info.value.message
    retry = int(info.value.response.headers["retry-after"])
    assert 0 < retry <= 86400
    assert len(fake.requests) == 2


def test_two_gateways_sharing_redis_enforce_one_budget(make_gateway: GatewayFactory,
                                                       tmp_path: Path,
                                                       fake: FakeInference) -> None:
    """Two gateway processes' worth of state (two gateways, one real redis-server)
    enforce one sandbox budget: within one in-flight request per replica."""
    from helpers.redis_server import RedisServer

    redis = RedisServer(tmp_path / "redis")
    redis.start()
    try:
        secrets = tmp_path / "s.yaml"
        secrets.write_text(f"provider-key: {KEY}\n")
        secrets.chmod(0o600)
        config = {"secrets": {"store": "file", "path": str(secrets)},
                  "state": {"store": "redis", "url": redis.url},
                  "network": {"upstream_ca": str(fake.ca_path),
                              "resolve": {n: f"127.0.0.1:{fake.port}" for n in NAMES}}}
        gws = [make_gateway({"agent.yaml": POLICY.format(requests=4)}, config=config)
               for _ in range(2)]
        token = gws[0].mint("agent")
        answers = []
        for i in range(8):
            with _http(gws[i % 2], token) as http:
                r = http.post("https://api.openai.com/v1/chat/completions",
                              headers={"Authorization": f"Bearer {token}"},
                              json={"model": "gpt-4o-mini",
                                    "messages": [{"role": "user", "content": "hi"}]})
            answers.append(r.status_code)
            time.sleep(0.6)  # counters are shared every 0.25 s
        assert answers.count(200) == 4 and answers.count(429) == 4, answers
        assert len([r for r in fake.requests if r.path == "/v1/chat/completions"]) == 4
    finally:
        redis.stop()
