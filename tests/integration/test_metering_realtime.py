"""Realtime sessions through the real gateway, on both intercept engines: a `websockets`
client opens `wss://api.openai.com/v1/realtime` with its gateway token (the fake sees
the real key), two responses' usage adds up on the session's audit line, in metrics and
in `/v1/usage`; a session whose responses use up a token budget has its next messages
refused with the provider's error event while the session goes on, and the next session
is refused before the upgrade reaches the provider."""

from __future__ import annotations

import json
import ssl
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets.exceptions
import websockets.sync.client
from fakes.realtime import SNAPSHOT, FakeRealtime
from helpers import ws_client
from helpers.clock import far_window
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.metrics import metric
from helpers.tls import LocalCA

from gateway.core.metering.pricing import Pricing
from gateway.core.metering.usage import Usage
from gateway.services.metering.catalogue import catalogue

KEY = "sk-fake-realtime-key-0123456789"
POLICY = """
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
    models: ["gpt-realtime*"]
budgets:
  - name: sandbox-daily
    per: sandbox
    window: {window}
    tokens: 500
credentials:
  openai: {{preset: openai, secret: provider-key}}
"""
URL = "wss://api.openai.com/v1/realtime?model=gpt-realtime"


@pytest.fixture
def realtime(test_ca: LocalCA, tmp_path: Path) -> Iterator[FakeRealtime]:
    server = FakeRealtime(tmp_path / "realtime", test_ca, ["api.openai.com"])
    yield server
    server.stop()


@pytest.fixture(params=["fast", "mitmproxy"])
def gw(request: pytest.FixtureRequest, make_gateway: GatewayFactory, tmp_path: Path,
       realtime: FakeRealtime) -> GatewayThread:
    secrets = tmp_path / "secrets.yaml"
    secrets.write_text(f"provider-key: {KEY}\n")
    secrets.chmod(0o600)
    # Each response.create reserves its bound: the model's context window and output
    # limit (from metering.pricing here: small, so a few responses fit the budget).
    pricing = tmp_path / "pricing.yaml"
    pricing.write_text('"gpt-realtime*": {context_window: 100, max_output_tokens: 100}\n')
    return make_gateway({"agent.yaml": POLICY.format(window=far_window())}, config={
        "metering": {"pricing": str(pricing)},
        "secrets": {"store": "file", "path": str(secrets)},
        "network": {"intercept": request.param,
                    "resolve": {"api.openai.com": f"127.0.0.1:{realtime.port}"}}})


def _connect(gw: GatewayThread, token: str, url: str = URL
             ) -> websockets.sync.client.ClientConnection:
    return ws_client.connect(
        url, proxy=gw.proxy_url(token), open_timeout=10,
        ssl=ssl.create_default_context(cafile=gw.ca_cert),
        additional_headers={"Authorization": f"Bearer {token}"})


def _events_until(ws: websockets.sync.client.ClientConnection, kind: str) -> list[dict]:
    events = []
    while True:
        event = json.loads(ws.recv(timeout=10))
        events.append(event)
        if event["type"] == kind:
            return events


def _session_lines(gw: GatewayThread, count: int) -> list[dict]:
    deadline = time.monotonic() + 5
    while True:
        lines = gw.audit.wait_for(lambda r: r.get("path") == "/v1/realtime")
        if len(lines) >= count or time.monotonic() > deadline:
            assert len(lines) == count, lines
            return lines
        time.sleep(0.05)


def test_a_realtime_session_is_metered_and_budgeted(gw: GatewayThread,
                                                    realtime: FakeRealtime) -> None:
    token = gw.mint("agent")
    model = "gpt-realtime" + SNAPSHOT
    base_in = metric(gw, "sandbox_gateway_inference_tokens_total", kind="input", model=model)
    base_requests = metric(gw, "sandbox_gateway_inference_requests_total", status="101",
                           model=model)  # (metrics are per process: other tests add too)
    with _connect(gw, token) as ws:
        _events_until(ws, "session.created")
        for _ in range(2):
            ws.send(json.dumps({"type": "response.create"}))
            _events_until(ws, "response.done")
    assert realtime.upgrades[0]["authorization"] == f"Bearer {KEY}"  # swapped

    (n_in0, n_out0, c0), (n_in1, n_out1, c1) = realtime.usage(0), realtime.usage(1)
    # priced from the model catalogue (the pricing file above sets only limits)
    prices = Pricing({}, "catalogue", catalogue())
    expected = {"model": model, "input_tokens": n_in0 + n_in1,
                "output_tokens": n_out0 + n_out1, "cached_input_tokens": c0 + c1,
                "cost_usd": pytest.approx(prices.cost(Usage(
                    model, n_in0 + n_in1, n_out0 + n_out1, c0 + c1)))}
    [line] = _session_lines(gw, 1)
    # time to first chunk: from the first response.create to the first delta
    assert 0 < line["usage"].pop("first_chunk_ms") <= line["duration_ms"]
    assert line["status"] == 101 and line["usage"] == expected
    assert KEY not in json.dumps(line)
    assert metric(gw, "sandbox_gateway_inference_tokens_total", kind="input",
                  model=model) - base_in == expected["input_tokens"]
    assert metric(gw, "sandbox_gateway_inference_requests_total", status="101",
                  model=model) - base_requests == 1
    usage = json.loads(urllib.request.urlopen(urllib.request.Request(
        gw.admin + "/v1/usage?sandbox=sandbox-1",
        headers={"Authorization": f"Bearer {gw.gateway.admin_token}"}), timeout=5).read())
    assert usage["totals"]["input_tokens"] == expected["input_tokens"]
    assert usage["totals"]["output_tokens"] == expected["output_tokens"]
    assert usage["totals"]["requests"] == 1

    # 241 tokens of a 500 budget: the next session may open. Its first response (which
    # reserved 200: its context window and output limit) takes the sandbox to 361: the
    # session's next response.create, which would reserve 200 more, is refused.
    with _connect(gw, token) as ws:
        _events_until(ws, "session.created")
        ws.send(json.dumps({"type": "response.create"}))
        _events_until(ws, "response.done")
        # Refused as the provider would: its error event, and the session goes on (on
        # both engines: the message is dropped, the gateway answers in its place).
        for note in ("over the budget", "still over"):
            ws.send(json.dumps({"type": "response.create", "note": note}))
            error = json.loads(ws.recv(timeout=5))
            assert error["type"] == "error", error
            assert error["error"]["message"].startswith("budget_exceeded: "), error
            assert "sandbox-daily" in error["error"]["message"]
    assert [e.get("note") for e in realtime.received if e.get("note")] == []
    lines = _session_lines(gw, 4)
    refused_lines = [line for line in lines if line["decision"] == "deny"]
    assert [line["error"] for line in refused_lines] == ["budget_exceeded"] * 2
    assert "sandbox-daily" in refused_lines[0]["reason"]
    n_in2, n_out2, c2 = realtime.usage(0)  # (the session's own first response)
    assert lines[-1]["decision"] == "allow" and lines[-1]["status"] == 101
    assert lines[-1]["usage"].pop("first_chunk_ms") > 0
    assert lines[-1]["usage"] == {**expected, "input_tokens": n_in2,
                                  "output_tokens": n_out2, "cached_input_tokens": c2,
                                  "cost_usd": pytest.approx(prices.cost(Usage(
                                      model, n_in2, n_out2, c2)))}
    usage = json.loads(urllib.request.urlopen(urllib.request.Request(
        gw.admin + "/v1/usage?sandbox=sandbox-1",
        headers={"Authorization": f"Bearer {gw.gateway.admin_token}"}), timeout=5).read())
    assert usage["totals"]["input_tokens"] == expected["input_tokens"] + n_in2
    assert usage["totals"]["requests"] == 2
    # 361 of 500: a session may open (it is no response), but no response fits in it.
    with _connect(gw, token) as ws:
        _events_until(ws, "session.created")
        ws.send(json.dumps({"type": "response.create", "note": "no room"}))
        error = json.loads(ws.recv(timeout=5))
        # final until the window resets: the provider's quota shape, our code first
        assert error["type"] == "error" and error["error"]["code"] == "insufficient_quota"
        assert error["error"]["message"].startswith("budget_exceeded")
    assert [e.get("note") for e in realtime.received if e.get("note")] == []


def test_a_realtime_session_for_another_model_is_refused(gw: GatewayThread,
                                                          realtime: FakeRealtime) -> None:
    token = gw.mint("agent")
    with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
        _connect(gw, token, "wss://api.openai.com/v1/realtime?model=gpt-4o-realtime-preview")
    assert refused.value.response.status_code == 403
    assert json.loads(refused.value.response.body or b"{}")["error"]["code"] == \
        "model_not_allowed"
    assert realtime.upgrades == []
