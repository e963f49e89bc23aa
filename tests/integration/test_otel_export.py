"""OpenTelemetry export (issue 45) through the real gateway, on both intercepting engines,
over OTLP/gRPC and OTLP/HTTP, to a real OTLP receiver (helpers/otlp_receiver.py: the
protocol's own gRPC services and HTTP endpoints, decoded with opentelemetry-proto).

A refused request, an inference call (the official `openai` SDK against the fake
provider, tests/fakes/inference.py) and MCP tool calls (raw JSON-RPC through httpx) each
arrive as a span and a log record with the named attributes; the spans continue the
sandbox's W3C traceparent; GenAI metrics arrive; no secret (the provider key, the
gateway token) is in any exported byte; nothing adds a trace header upstream, except to
the hosts of `telemetry.propagate`, where the gateway's span is the upstream's parent."""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import websockets.exceptions
import websockets.sync.client
from fakes.inference import FakeInference
from fakes.realtime import SNAPSHOT, FakeRealtime
from helpers import ws_client
from helpers.dlp_corpus import fake as fake_credential
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.otlp_receiver import OtlpReceiver
from helpers.tls import LocalCA
from helpers.upstream import Upstream

from gateway.pipeline.exchange import HOLD_LIMIT

KEY = "sk-otel-test-provider-key-5b1e"
GH = fake_credential("github").text
POLICY = """
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
    models: ["gpt-4o-mini*"]
  - host: api.allowed.test
    methods: [GET]
  - host: allowed.test
    mcp:
      tools: {allow: ["search_*"], deny: ["delete_*"]}
credentials:
  openai: {preset: openai, secret: provider-key}
"""
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENTS = {"refused": "00f067aa0ba902b7", "chat": "00f067aa0ba902b8", "mcp": "00f067aa0ba902b9"}


def _tp(parent: str) -> str:
    return f"00-{TRACE}-{parent}-01"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as server:
        yield server


def _gateway(make_gateway: GatewayFactory, tmp_path: Path, fake: FakeInference,
             upstream: Upstream, test_ca: LocalCA, endpoint: str, protocol: str,
             intercept: str, propagate: list[str] | None = None) -> GatewayThread:
    secrets = tmp_path / "s.yaml"
    secrets.write_text(f"provider-key: {KEY}\n")
    secrets.chmod(0o600)
    bundle = tmp_path / "upstream-ca.pem"  # the fake provider's CA and the upstream's
    bundle.write_bytes(Path(test_ca.cert_path).read_bytes() + fake.ca_path.read_bytes())
    return make_gateway({"agent.yaml": POLICY}, config={
        "secrets": {"store": "file", "path": str(secrets)},
        "network": {"intercept": intercept, "upstream_ca": str(bundle),
                    "resolve": {"api.openai.com": f"127.0.0.1:{fake.port}",
                                "allowed.test": f"127.0.0.1:{upstream.port}",
                                "api.allowed.test": f"127.0.0.1:{upstream.port}"}},
        "telemetry": {"endpoint": endpoint, "protocol": protocol, "metrics_interval": "1s",
                      "headers": {"x-collector-auth": "collector-secret-9f2"},
                      "propagate": propagate or []},
        "audit": {"otlp": True}})


def _mcp_call(tool: str, ident: int) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": ident, "method": "tools/call",
                       "params": {"name": tool, "arguments": {"query": "q"}}}).encode()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("intercept", ["fast", "mitmproxy"])
def test_refusal_inference_and_mcp_arrive_as_spans_logs_and_metrics(
        receiver: OtlpReceiver, make_gateway: GatewayFactory, tmp_path: Path,
        fake: FakeInference, upstream: Upstream, test_ca: LocalCA,
        monkeypatch: pytest.MonkeyPatch, intercept: str, protocol: str) -> None:
    # (`receiver` first: set up before the gateway, closed after it)
    # (the SDK's batch delay, read when the processors are built: exports within 0.2 s)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    monkeypatch.setenv("OTEL_BLRP_SCHEDULE_DELAY", "200")
    endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
    gw = _gateway(make_gateway, tmp_path, fake, upstream, test_ca, endpoint, protocol,
                  intercept)
    token = gw.mint("agent")
    verify = ssl.create_default_context(cafile=gw.ca_cert)
    with httpx.Client(proxy=gw.proxy_url(token), verify=verify, timeout=20) as http:
        refused = http.post("https://api.allowed.test/x?key=abc", content=b"{}",
                            headers={"traceparent": _tp(PARENTS["refused"])})
        assert refused.status_code == 403
        oai = openai.OpenAI(api_key=token, http_client=http, max_retries=0)
        chat = oai.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "secret prompt"}],
            extra_headers={"traceparent": _tp(PARENTS["chat"])})
        assert chat.usage is not None and chat.usage.completion_tokens == 4
        seen = len(upstream.requests)
        allowed = http.post("https://allowed.test/mcp", content=_mcp_call("search_issues", 1),
                            headers={"content-type": "application/json",
                                     "accept": "application/json, text/event-stream",
                                     "traceparent": _tp(PARENTS["mcp"])})
        assert allowed.status_code == 200
        denied = http.post("https://allowed.test/mcp", content=_mcp_call("delete_repo", 2),
                           headers={"content-type": "application/json",
                                    "accept": "application/json, text/event-stream"})
        assert denied.status_code in (200, 403), denied.text
    # The gateway adds no trace header to a request that came without one.
    assert len(upstream.requests) == seen + 1
    assert "traceparent" in {k.lower() for k in upstream.requests[seen].headers}

    def arrived() -> bool:
        names = {s["name"] for s in receiver.spans()}
        return {"POST api.allowed.test", "chat gpt-4o-mini", "tools/call search_issues",
                "tools/call delete_repo"} <= names and len(receiver.logs()) >= 4 and \
            "gen_ai.client.token.usage" in receiver.metrics()
    assert receiver.wait(arrived), (sorted(s["name"] for s in receiver.spans()),
                                    len(receiver.logs()), sorted(receiver.metrics()))
    spans = receiver.spans()
    by_name = {s["name"]: s for s in spans}
    engine = "mitmproxy" if intercept == "mitmproxy" else "h1"

    # The refused request: its decision, rule, code; a child of the sandbox's span.
    refusal = by_name["POST api.allowed.test"]
    attrs = refusal["attributes"]
    assert (refusal["trace_id"], refusal["parent_span_id"]) == (TRACE, PARENTS["refused"])
    assert attrs["sandbox_gateway.decision"] == "deny"
    assert attrs["error.type"] == "policy_denied", attrs
    assert attrs["sandbox_gateway.policy"] == "agent"
    assert attrs["sandbox_gateway.sandbox"] == "sandbox-1"
    assert attrs["sandbox_gateway.engine"] == engine
    assert attrs["sandbox_gateway.policy_revision"]
    assert attrs["http.response.status_code"] == 403
    assert attrs["url.path"] == "/x"  # (the query string never leaves)
    assert refusal["status"] == 2  # STATUS_CODE_ERROR
    assert refusal["resource"]["service.name"] == "sandbox-gateway"

    # The inference call: GenAI conventions.
    call = by_name["chat gpt-4o-mini"]
    attrs = call["attributes"]
    assert (call["trace_id"], call["parent_span_id"]) == (TRACE, PARENTS["chat"])
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "openai"
    assert attrs["gen_ai.request.model"] == "gpt-4o-mini"
    assert attrs["gen_ai.response.model"].startswith("gpt-4o-mini")
    assert attrs["gen_ai.usage.output_tokens"] == 4
    assert attrs["gen_ai.usage.input_tokens"] == chat.usage.prompt_tokens
    assert attrs["sandbox_gateway.decision"] == "allow"
    assert attrs["sandbox_gateway.path_taken"] == "intercept"
    assert attrs["sandbox_gateway.credential"] == "openai"
    assert call["end"] > call["start"]

    # MCP tool calls: tool-execution spans, children of their exchange's span.
    for tool, decision in (("search_issues", "allow"), ("delete_repo", "deny")):
        tool_span = by_name[f"tools/call {tool}"]
        assert tool_span["attributes"]["gen_ai.tool.name"] == tool
        assert tool_span["attributes"]["gen_ai.operation.name"] == "execute_tool"
        assert tool_span["attributes"]["mcp.method.name"] == "tools/call"
        assert tool_span["attributes"]["sandbox_gateway.decision"] == decision
        parent = next(s for s in spans if s["span_id"] == tool_span["parent_span_id"])
        assert parent["name"] == "POST allowed.test"
        assert parent["trace_id"] == tool_span["trace_id"]
    search_parent = next(s for s in spans
                         if s["span_id"] == by_name["tools/call search_issues"]["parent_span_id"])
    assert (search_parent["trace_id"], search_parent["parent_span_id"]) == (
        TRACE, PARENTS["mcp"])
    denied_parent = next(s for s in spans
                         if s["span_id"] == by_name["tools/call delete_repo"]["parent_span_id"])
    assert denied_parent["trace_id"] != TRACE and denied_parent["parent_span_id"] == ""

    # The audit lines as log records: the JSON line's fields, in their span's trace.
    logs = receiver.logs()
    records = gw.audit.records()
    bodies = [json.loads(r["body"]) for r in logs]
    assert len(bodies) == len(records)
    for line in records:  # (each the very line the JSON sink wrote)
        assert line in bodies, line
    assert {r["event_name"] for r in logs} == {"sandbox_gateway.audit"}
    chat_log = next(r for r, b in zip(logs, bodies, strict=True)
                    if (b.get("usage") or {}).get("output_tokens"))
    assert chat_log["span_id"] == call["span_id"] and chat_log["trace_id"] == TRACE
    assert json.loads(chat_log["body"])["trace"] == _tp(PARENTS["chat"])
    assert chat_log["attributes"]["sandbox_gateway.decision"] == "allow"
    assert chat_log["attributes"]["gen_ai.operation.name"] == "chat"
    refused_log = next(r for r, b in zip(logs, bodies, strict=True)
                       if b["error"] == "policy_denied")
    assert refused_log["attributes"]["error.type"] == "policy_denied"
    assert refused_log["severity"] == "WARN"

    # GenAI metrics.
    metrics = receiver.metrics()
    points = metrics["gen_ai.client.token.usage"]
    kinds = {a["value"]["stringValue"] for p in points for a in p["attributes"]
             if a["key"] == "gen_ai.token.type"}
    assert kinds == {"input", "output"}
    assert metrics["gen_ai.client.operation.duration"]

    # No secret anywhere: not the provider key, not the gateway token, not the prompt,
    # not the collector's own header value.
    raw = bytes(receiver.raw)
    for secret in (KEY, token, "secret prompt", "collector-secret-9f2", "key=abc"):
        assert secret.encode() not in raw, secret
    # Without telemetry: {content: true} nothing of a body goes: not the completion, not
    # the MCP call's arguments, no content attribute.
    assert b"fake provider" not in raw and b'"query"' not in raw
    assert not [k for s in spans for k in s["attributes"]
                if k.startswith(("gen_ai.input", "gen_ai.output", "gen_ai.tool.call.",
                                 "sandbox_gateway.request.content"))]


@pytest.mark.parametrize("intercept", ["fast", "mitmproxy"])
def test_propagate_sends_the_gateway_s_span_upstream_to_the_hosts_named_only(
        receiver: OtlpReceiver, make_gateway: GatewayFactory, tmp_path: Path,
        fake: FakeInference, upstream: Upstream, test_ca: LocalCA,
        monkeypatch: pytest.MonkeyPatch, intercept: str) -> None:
    """`telemetry.propagate: [api.allowed.test]`: a request there leaves with the
    gateway's span as its `traceparent` (a new trace, or the sandbox's trace with the
    gateway's span in place of the sandbox's), and that span arrives with those ids, the
    sandbox's span its parent; the audit line keeps both headers. A request to another
    host leaves with the trace headers it came with, none added."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    monkeypatch.setenv("OTEL_BLRP_SCHEDULE_DELAY", "200")
    gw = _gateway(make_gateway, tmp_path, fake, upstream, test_ca, receiver.grpc_endpoint,
                  "grpc", intercept, propagate=["api.allowed.test"])
    token = gw.mint("agent")
    verify = ssl.create_default_context(cafile=gw.ca_cert)
    sandbox = _tp(PARENTS["refused"])
    with httpx.Client(proxy=gw.proxy_url(token), verify=verify, timeout=20) as http:
        for headers in ({}, {"traceparent": sandbox, "tracestate": "vendor=1"}):
            assert http.get("https://api.allowed.test/a", headers=headers).status_code == 200
        assert http.post("https://allowed.test/mcp", content=_mcp_call("search_issues", 1),
                         headers={"content-type": "application/json",
                                  "accept": "application/json, text/event-stream"}
                         ).status_code == 200
    sent = [{k.lower(): v for k, v in r.headers.items()} for r in upstream.requests[-3:]]
    assert "traceparent" not in sent[2]  # (another host: nothing added)
    new, child = sent[0]["traceparent"], sent[1]["traceparent"]
    assert new.startswith("00-") and new.endswith("-01") and TRACE not in new
    assert child.startswith(f"00-{TRACE}-") and PARENTS["refused"] not in child
    assert sent[1]["tracestate"] == "vendor=1"
    lines = [r for r in gw.audit.records() if r["host"] == "api.allowed.test"]
    assert [(r["trace"], r["trace_sent"]) for r in lines] == [(None, new), (sandbox, child)]
    assert receiver.wait(lambda: sum(s["name"] == "GET api.allowed.test"
                                     for s in receiver.spans()) == 2)
    spans = sorted((s for s in receiver.spans() if s["name"] == "GET api.allowed.test"),
                   key=lambda s: s["start"])
    for span, header, parent in ((spans[0], new, ""), (spans[1], child, PARENTS["refused"])):
        _, trace_id, span_id, _ = header.split("-")
        assert (span["trace_id"], span["span_id"], span["parent_span_id"]) == (
            trace_id, span_id, parent)


CONTENT_POLICY = POLICY + """---
version: v1
name: talker
telemetry: {content: true}
egress:
  - host: api.openai.com
    credential: openai
    models: ["gpt-4o-mini*"]
  - host: allowed.test
    mcp:
      tools: {allow: ["search_*"]}
"""


@pytest.mark.parametrize("intercept", ["fast", "mitmproxy"])
def test_time_to_first_chunk_and_content_only_where_a_policy_opts_in(
        receiver: OtlpReceiver, make_gateway: GatewayFactory, tmp_path: Path,
        fake: FakeInference, upstream: Upstream, test_ca: LocalCA,
        monkeypatch: pytest.MonkeyPatch, intercept: str) -> None:
    """A streamed call's span has the time to its first chunk (both policies); only the
    policy with `telemetry: {content: true}` exports its prompt, completion and tool
    arguments, with a credential in the prompt replaced; the other policy's spans carry
    none, and the audit lines (log records) never do."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    monkeypatch.setenv("OTEL_BLRP_SCHEDULE_DELAY", "200")
    secrets = tmp_path / "s.yaml"
    secrets.write_text(f"provider-key: {KEY}\n")
    secrets.chmod(0o600)
    bundle = tmp_path / "upstream-ca.pem"
    bundle.write_bytes(Path(test_ca.cert_path).read_bytes() + fake.ca_path.read_bytes())
    gw = make_gateway({"agent.yaml": CONTENT_POLICY}, config={
        "secrets": {"store": "file", "path": str(secrets)},
        "network": {"intercept": intercept, "upstream_ca": str(bundle),
                    "resolve": {"api.openai.com": f"127.0.0.1:{fake.port}",
                                "allowed.test": f"127.0.0.1:{upstream.port}"}},
        "telemetry": {"endpoint": receiver.grpc_endpoint, "metrics_interval": "1s"},
        "audit": {"otlp": True}})
    verify = ssl.create_default_context(cafile=gw.ca_cert)
    prompts = {"agent": "plain agent prompt", "talker": "talker prompt, key " + GH}
    for policy in ("agent", "talker"):
        token = gw.mint(policy)
        with httpx.Client(proxy=gw.proxy_url(token), verify=verify, timeout=20) as http:
            oai = openai.OpenAI(api_key=token, http_client=http, max_retries=0)
            stream = oai.chat.completions.create(
                model="gpt-4o-mini", stream=True,
                messages=[{"role": "user", "content": prompts[policy]}],
                extra_headers={"x-policy": policy})
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert text == "The fake provider answers."
            if policy == "talker":
                answer = http.post("https://allowed.test/mcp/answer/json",
                                   content=_mcp_call("search_issues", 7),
                                   headers={"content-type": "application/json",
                                            "accept": "application/json, text/event-stream"})
                assert answer.status_code == 200, answer.text

    def arrived() -> bool:
        spans = receiver.spans()
        return sum(s["name"] == "chat gpt-4o-mini" for s in spans) == 2 and \
            any(s["name"] == "tools/call search_issues" for s in spans) and \
            len(receiver.logs()) >= 3 and \
            "gen_ai.client.operation.time_to_first_chunk" in receiver.metrics()
    assert receiver.wait(arrived), sorted(s["name"] for s in receiver.spans())
    spans = receiver.spans()
    chats = {s["attributes"]["sandbox_gateway.policy"]: s for s in spans
             if s["name"] == "chat gpt-4o-mini"}
    for span in chats.values():  # time to first chunk: within the call
        first = span["attributes"]["gen_ai.response.time_to_first_chunk"]
        assert 0 < first * 1e9 <= span["end"] - span["start"]
    lines = [line for line in gw.audit.records() if line.get("usage")]
    assert all(0 < line["usage"]["first_chunk_ms"] <= line["duration_ms"] for line in lines)
    assert receiver.metrics()["gen_ai.client.operation.time_to_first_chunk"]

    talker = chats["talker"]["attributes"]
    assert "talker prompt, key [REDACTED]" in talker["gen_ai.input.messages"]
    assert "provider" in talker["gen_ai.output.messages"]  # (the SSE deltas as relayed)
    tool = next(s for s in spans if s["name"] == "tools/call search_issues")["attributes"]
    assert json.loads(tool["gen_ai.tool.call.arguments"]) == {"query": "q"}
    assert "tools" in json.loads(tool["gen_ai.tool.call.result"])
    assert not [k for k in chats["agent"]["attributes"] if k.startswith("gen_ai.input")]
    raw = bytes(receiver.raw)
    for secret in (GH, KEY, prompts["agent"]):
        assert secret.encode() not in raw, secret
    for record in receiver.logs():  # (the audit line: no content ever)
        assert "talker prompt" not in record["body"] and "fake provider" not in record["body"]


def _dropped(gw: GatewayThread, signal: str) -> float:
    """`sandbox_gateway_telemetry_export_dropped_total` of `signal` at /metrics, as the
    worker reports it (what the exporter process dropped because nothing took it)."""
    text = httpx.get(f"{gw.admin}/metrics").text
    name = (f'sandbox_gateway_telemetry_export_dropped_total{{reason="unreachable",'
            f'signal="{signal}"}} ')
    return sum(float(row[len(name):]) for row in text.splitlines() if row.startswith(name))


@pytest.fixture
def collectors() -> Iterator[list[OtlpReceiver]]:
    """Receivers a test starts, closed after its gateway (requested before it)."""
    started: list[OtlpReceiver] = []
    yield started
    for server in started:
        server.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_collector_down_is_counted_at_metrics_and_the_export_resumes_when_it_is_back(
        collectors: list[OtlpReceiver], make_gateway: GatewayFactory, protocol: str
        ) -> None:
    """The collector down: what the exporter process could not send after its retries
    is counted at the worker's /metrics, by signal; the collector back on its port: the
    next requests' spans and log records arrive."""
    with OtlpReceiver() as gone:  # (a collector's ports, then nothing listens there)
        ports = (gone.grpc_port, gone.http_port)
    port = ports[0] if protocol == "grpc" else ports[1]
    gw = make_gateway(config={
        "telemetry": {"endpoint": f"http://127.0.0.1:{port}", "protocol": protocol,
                      "metrics": False},
        "audit": {"otlp": True}})
    before = {s: _dropped(gw, s) for s in ("traces", "logs")}
    verify = ssl.create_default_context(cafile=gw.ca_cert)
    with httpx.Client(proxy=gw.proxy_url(gw.mint("agent")), verify=verify,
                      timeout=20) as http:
        for n in range(5):
            assert http.get(f"https://other.test/down/{n}").status_code == 200

        def counted() -> bool:
            return all(_dropped(gw, s) >= before[s] + 5 for s in before)
        deadline = time.monotonic() + 20  # (0.2 s batching, 1.5 s of retries, reports)
        while not counted() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert counted(), {s: _dropped(gw, s) - before[s] for s in before}
        # (back on the port the gateway sends to; the other on a free one: another test
        # may have taken it since, and a bind of it failed the test)
        back = OtlpReceiver(*(p if n == ports.index(port) else 0 for n, p in enumerate(ports)))
        collectors.append(back)
        for n in range(3):
            assert http.get(f"https://other.test/back/{n}").status_code == 200

    def arrived() -> bool:
        paths = {s["attributes"].get("url.path") for s in back.spans()}
        bodies = [json.loads(r["body"])["path"] for r in back.logs()]
        return {f"/back/{n}" for n in range(3)} <= paths and \
            {f"/back/{n}" for n in range(3)} <= set(bodies)
    assert back.wait(arrived, timeout=20), [s["name"] for s in back.spans()]
    assert not [s for s in back.spans() if s["attributes"]["url.path"].startswith("/down/")]


SESSION = "chat gpt-realtime" + SNAPSHOT  # (the Realtime session's span: a metered call)
WS_POLICY = """
version: v1
name: talker
telemetry: {content: true}
egress:
  - host: api.openai.com
    credential: openai
  - host: allowed.test
    inspect: true
credentials:
  openai: {preset: openai, secret: provider-key}
"""


@pytest.mark.parametrize("intercept", ["fast", "mitmproxy"])
def test_websocket_messages_and_streamed_bodies_are_exported_redacted(
        receiver: OtlpReceiver, make_gateway: GatewayFactory, tmp_path: Path,
        upstream: Upstream, test_ca: LocalCA, intercept: str) -> None:
    """`telemetry: {content: true}`: a Realtime session's messages (the sandbox's as
    input, the provider's as output) and a request body streamed through (over the hold
    limit, never held whole) are exported, capped, with a GitHub token replaced (the DLP
    detectors) and the provider key replaced (the log's redaction) in the sandbox's
    message and in the provider's echo of it; the session's span has its time to first
    chunk (from response.create to the first delta). A message with the gateway token
    is refused, and the token never reaches the collector."""
    realtime = FakeRealtime(tmp_path / "realtime", test_ca, ["api.openai.com"])
    try:
        secrets = tmp_path / "s.yaml"
        secrets.write_text(f"provider-key: {KEY}\n")
        secrets.chmod(0o600)
        gw = make_gateway({"agent.yaml": WS_POLICY}, config={
            "secrets": {"store": "file", "path": str(secrets)},
            "network": {"intercept": intercept,
                        "resolve": {"api.openai.com": f"127.0.0.1:{realtime.port}",
                                    "allowed.test": f"127.0.0.1:{upstream.port}"}},
            "telemetry": {"endpoint": receiver.grpc_endpoint, "metrics": False}})
        token = gw.mint("talker")
        verify = ssl.create_default_context(cafile=gw.ca_cert)
        with ws_client.connect(
                "wss://api.openai.com/v1/realtime?model=gpt-realtime",
                proxy=gw.proxy_url(token), open_timeout=10, ssl=verify,
                additional_headers={"Authorization": f"Bearer {token}"}) as ws:
            _ws_until(ws, "session.created")
            ws.send(json.dumps({"type": "session.update", "session": {
                "instructions": f"be brief {GH} {KEY}"}}))
            echoed = _ws_until(ws, "session.updated")[-1]
            # (the provider's echo of the key is redacted on its way to the sandbox)
            assert echoed["session"]["instructions"] == f"be brief {GH} [REDACTED]"
            ws.send(json.dumps({"type": "response.create"}))
            _ws_until(ws, "response.done")
        with ws_client.connect(
                "wss://api.openai.com/v1/realtime?model=gpt-realtime",
                proxy=gw.proxy_url(token), open_timeout=10, ssl=verify,
                additional_headers={"Authorization": f"Bearer {token}"}) as ws:
            _ws_until(ws, "session.created")
            ws.send(json.dumps({"type": "session.update", "session": {
                "instructions": f"token {token}"}}))
            try:  # (refused: the fast engine closes the session, mitmproxy drops it)
                _ws_until(ws, "session.updated", timeout=3)
                raise AssertionError("a message with the gateway token was relayed")
            except (websockets.exceptions.ConnectionClosed, TimeoutError):
                pass
        assert any(r["error"] == "exfiltration_blocked" for r in gw.audit.records())
        assert not [e for e in realtime.received if token in json.dumps(e)]
        body = f"upload {GH} ".encode() + b"z" * (HOLD_LIMIT + 4096)
        with httpx.Client(proxy=gw.proxy_url(token), verify=verify, timeout=20) as http:
            sent = http.post("https://allowed.test/upload", content=iter(
                [body[:100], body[100:]]))  # (chunked, over the hold limit: streamed)
            assert sent.status_code == 200

        def arrived() -> bool:
            names = [s["name"] for s in receiver.spans()]
            return names.count(SESSION) >= 2 and "POST allowed.test" in names
        assert receiver.wait(arrived), [s["name"] for s in receiver.spans()]
    finally:
        realtime.stop()
    spans = receiver.spans()
    session = next(s for s in spans if s["name"] == SESSION
                   and s["attributes"]["http.response.status_code"] == 101)
    attrs = session["attributes"]
    assert attrs["gen_ai.operation.name"] == "chat"
    sent_lines = attrs["gen_ai.input.messages"].splitlines()
    assert [json.loads(line)["type"] for line in sent_lines] == [
        "session.update", "response.create"]
    assert json.loads(sent_lines[0])["session"]["instructions"] == \
        "be brief [REDACTED] [REDACTED]"
    got = [json.loads(line) for line in
           attrs["gen_ai.output.messages"].splitlines()]
    assert [e["type"] for e in got][:2] == ["session.created", "session.updated"]
    assert got[1]["session"]["instructions"] == "be brief [REDACTED] [REDACTED]"
    assert "response.audio_transcript.delta" in [e["type"] for e in got]
    first = attrs["gen_ai.response.time_to_first_chunk"]
    assert 0 < first * 1e9 <= session["end"] - session["start"]
    [line] = [r for r in gw.audit.records() if r.get("status") == 101 and r.get("usage")]
    assert 0 < line["usage"]["first_chunk_ms"] <= line["duration_ms"]
    upload = next(s for s in spans if s["name"] == "POST allowed.test")["attributes"]
    exported = upload["sandbox_gateway.request.content"]
    assert exported.startswith("upload [REDACTED] zzz") and exported.endswith("…[cut]")
    assert len(exported) == 16 * 1024 + len("…[cut]")
    raw = bytes(receiver.raw)
    for secret in (GH, KEY, token):
        assert secret.encode() not in raw, secret


def _ws_until(ws: websockets.sync.client.ClientConnection, kind: str,
              timeout: float = 10) -> list[dict[str, Any]]:
    events = []
    while True:
        events.append(json.loads(ws.recv(timeout=timeout)))
        if events[-1]["type"] == kind:
            return events


@pytest.mark.parametrize("intercept", ["fast", "mitmproxy"])
def test_a_responses_websocket_session_has_its_time_to_first_chunk(
        receiver: OtlpReceiver, make_gateway: GatewayFactory, tmp_path: Path,
        test_ca: LocalCA, intercept: str) -> None:
    """A Responses-WebSocket session (wss://…/v1/responses): time to first chunk from
    its response.create to the first response.output_text.delta, on its span and its
    audit line; its events exported (content: true) with a key in the input replaced."""
    realtime = FakeRealtime(tmp_path / "realtime", test_ca, ["api.openai.com"])
    try:
        secrets = tmp_path / "s.yaml"
        secrets.write_text(f"provider-key: {KEY}\n")
        secrets.chmod(0o600)
        gw = make_gateway({"agent.yaml": WS_POLICY}, config={
            "secrets": {"store": "file", "path": str(secrets)},
            "network": {"intercept": intercept,
                        "resolve": {"api.openai.com": f"127.0.0.1:{realtime.port}"}},
            "telemetry": {"endpoint": receiver.grpc_endpoint, "metrics": False}})
        token = gw.mint("talker")
        with ws_client.connect(
                "wss://api.openai.com/v1/responses", proxy=gw.proxy_url(token),
                open_timeout=10, ssl=ssl.create_default_context(cafile=gw.ca_cert),
                additional_headers={"Authorization": f"Bearer {token}"}) as ws:
            ws.send(json.dumps({"type": "response.create", "model": "gpt-4o-mini",
                                "input": f"say hi, key {GH}"}))
            events = _ws_until(ws, "response.completed")
        assert "response.output_text.delta" in [e["type"] for e in events]
        assert receiver.wait(lambda: any(s["name"].startswith("chat gpt-4o-mini")
                                         for s in receiver.spans()))
    finally:
        realtime.stop()
    span = next(s for s in receiver.spans() if s["name"].startswith("chat gpt-4o-mini"))
    attrs = span["attributes"]
    first = attrs["gen_ai.response.time_to_first_chunk"]
    assert 0 < first * 1e9 <= span["end"] - span["start"]
    [line] = [r for r in gw.audit.records() if r.get("path") == "/v1/responses"]
    assert 0 < line["usage"]["first_chunk_ms"] <= line["duration_ms"]
    assert "[REDACTED]" in attrs["gen_ai.input.messages"]
    assert "response.output_text.delta" in attrs["gen_ai.output.messages"]
    assert GH.encode() not in bytes(receiver.raw) and token.encode() not in receiver.raw
