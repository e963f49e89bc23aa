"""The metering step end to end without an engine: admit -> response bytes -> complete,
then the same totals from the audit records, Prometheus, `GET /v1/usage` (Starlette app)
and `sandbox-gateway usage` (a real admin server on loopback)."""

from __future__ import annotations

import datetime as dt
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.testclient import TestClient

from gateway.api.admin import AdminContext, build_admin_app
from gateway.cli import main
from gateway.config import Config, ConfigError, MeteringConfig, load_config
from gateway.core.metering import ModelRefusal
from gateway.core.metering.pricing import parse_pricing
from gateway.core.policy import PolicySet
from gateway.observability import metrics
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.identity.tokens import TokenService
from gateway.services.metering import BudgetExceeded, Exchange, Metered, Metering
from gateway.services.metering.service import build_metering
from gateway.services.policy import load_policy_texts
from gateway.services.state.base import MemoryState
from gateway.services.state.sqlite import SqliteState

DATA = Path(__file__).resolve().parents[2] / "data" / "metering"
ADMIN = "admin-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
NOW = dt.datetime(2026, 11, 22, 10, 30, tzinfo=dt.UTC).timestamp()

POLICIES = {"agent.yaml": """\
version: v1
name: metered-agent
egress:
  - host: api.openai.com
    credential: openai-m
    models: ["gpt-4o-mini*", "gpt-4.1*"]
    metering: {reserve: 10}
  - host: api.anthropic.com
    credential: anthropic-m
    metering: {reserve: 10}
budgets:
  - {name: daily, per: sandbox, window: 24h, tokens: 100}
credentials:
  openai-m: {preset: openai, secret: k1}
  anthropic-m: {preset: anthropic, secret: k2}
"""}

# Prices, and output limits small enough for the 100-token budget (a real model's from the
# catalogue would be thousands: no call without max_tokens could fit).
PRICING = parse_pricing({
    "gpt-4o-mini*": {"input": 0.15, "output": 0.60, "cached_input": 0.075,
                     "max_output_tokens": 9},
    "claude-*": {"input": 3, "output": 15, "cached_input": 0.3, "max_output_tokens": 10},
    "gpt-4.1*": {"max_output_tokens": 10}})


def counter_value(metric: str, labels: dict[str, str]) -> float:
    return metrics.REGISTRY.get_sample_value(metric, labels) or 0.0


class Harness:
    """Metering over a state store, with the policy set, driving exchanges."""

    def __init__(self, state_dir: Path, state: MemoryState | None = None) -> None:
        self.state_dir = state_dir
        self.policies: PolicySet = load_policy_texts(POLICIES)
        self.state = state or MemoryState(clock=lambda: NOW)
        self.metering = Metering(self.state, pricing=PRICING, telemetry=metrics.TELEMETRY)
        self.records: list[dict[str, Any]] = []

    def exchange(self, sandbox: str, credential: str, path: str, body: bytes | None,
                 response: bytes | None, status: int = 200, now: float = NOW,
                 method: str = "POST") -> Exchange | ModelRefusal | BudgetExceeded:
        policy = self.policies.policies["metered-agent"]
        rule = next(r for r in policy.rules if r.credential == credential)
        preset = self.policies.credentials[credential].preset
        step = self.metering.admit(sandbox=sandbox, policy=policy, rule=rule, preset=preset,
                                   method=method, path=path, body=body, now=now)
        if isinstance(step, Exchange):
            for i in range(0, len(response or b""), 97):
                step.feed((response or b"")[i:i + 97])
            done: Metered = self.metering.complete(step, status, now)
            record = done.as_record()
            if record is not None:
                self.records.append({"sandbox": sandbox, "credential": credential, **record})
        return step


def fixture(name: str) -> bytes:
    return (DATA / name).read_bytes()


def test_admit_and_complete_count_everywhere(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    labels = {"policy": "metered-agent", "credential": "openai-m",
              "model": "gpt-4o-mini-2024-07-18"}
    before_in = counter_value("sandbox_gateway_inference_tokens_total",
                              {**labels, "kind": "input"})
    before_req = counter_value("sandbox_gateway_inference_requests_total",
                               {**labels, "status": "200"})
    body = b'{"model":"gpt-4o-mini","messages":[],"stream":true}'
    step = h.exchange("sb-1", "openai-m", "/v1/chat/completions", body,
                      fixture("openai_chat_stream_usage.sse"))
    assert isinstance(step, Exchange)
    # The stream had no include_usage: the body to forward asks for it.
    assert step.body == (b'{"stream_options":{"include_usage":true},"model":"gpt-4o-mini",'
                         b'"messages":[],"stream":true}')
    assert h.records[-1] == {"sandbox": "sb-1", "credential": "openai-m",
                             "model": "gpt-4o-mini-2024-07-18", "input_tokens": 9,
                             "output_tokens": 12, "cached_input_tokens": 0,
                             "cost_usd": pytest.approx((9 * 0.15 + 12 * 0.60) / 1e6),
                             # reserved: the model's output limit 9 + the 91 bytes sent
                             "budget": {"reserved_tokens": 100, "charged_tokens": 21,
                                        "basis": "usage"}}
    assert counter_value("sandbox_gateway_inference_tokens_total",
                         {**labels, "kind": "input"}) == before_in + 9
    assert counter_value("sandbox_gateway_inference_requests_total",
                         {**labels, "status": "200"}) == before_req + 1
    # A request that is not an inference call: forwarded, not metered, not audited as usage.
    step = h.exchange("sb-1", "openai-m", "/v1/models", None, b'{"data": []}', method="GET")
    assert isinstance(step, Exchange) and step.meter is None and step.body is None
    assert len(h.records) == 1
    # A rule without a credential is not metered at all.
    plain = load_policy_texts({"p.yaml": "version: v1\nname: p\negress:\n"
                               "  - {host: api.openai.com, methods: [POST]}\n"}).policies["p"]
    step = h.metering.admit(sandbox="sb-1", policy=plain, rule=plain.rules[0], preset=None,
                            method="POST", path="/v1/chat/completions", body=b"{}", now=NOW)
    assert isinstance(step, Exchange) and step.meter is None
    assert h.metering.complete(step, 200, NOW).as_record() is None


def test_refusals(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    before = counter_value("sandbox_gateway_model_refusals_total",
                           {"policy": "metered-agent", "credential": "openai-m"})
    refused = h.exchange("sb-1", "openai-m", "/v1/chat/completions", b'{"model":"gpt-4o"}',
                         None)
    assert isinstance(refused, ModelRefusal)
    assert (refused.status, refused.code, refused.rule) == (403, "model_not_allowed",
                                                            "agent.yaml:4")
    assert counter_value("sandbox_gateway_model_refusals_total",
                         {"policy": "metered-agent", "credential": "openai-m"}) == before + 1
    # 9 + 12 tokens per exchange, each reserving 32 (9 output + 23 body bytes): four fit
    # in 100, the 5th could cross it and is refused.
    for _ in range(4):
        assert isinstance(h.exchange("sb-1", "openai-m", "/v1/chat/completions",
                                     b'{"model":"gpt-4o-mini"}',
                                     fixture("openai_chat_stream_usage.sse")), Exchange)
    refused_budget = h.exchange("sb-1", "openai-m", "/v1/chat/completions",
                                b'{"model":"gpt-4o-mini"}', None, now=NOW + 60)
    assert isinstance(refused_budget, BudgetExceeded)
    assert refused_budget.frees_in == 13 * 3600 + 29 * 60
    assert refused_budget.retry_after is None  # (hours away: no Retry-After)
    assert "has 16 tokens left" in refused_budget.reason
    assert "may use up to 32 tokens" in refused_budget.reason
    # Other sandboxes have their own allowance; GET /v1/models is never limited.
    assert isinstance(h.exchange("sb-2", "openai-m", "/v1/chat/completions",
                                 b'{"model":"gpt-4o-mini"}', b"{}"), Exchange)
    assert isinstance(h.exchange("sb-1", "openai-m", "/v1/models", None, b"{}",
                                 method="GET"), Exchange)


def test_failed_exchange_counts_as_request_with_unknown_tokens(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    before = counter_value("sandbox_gateway_inference_requests_total", {
        "policy": "metered-agent", "credential": "anthropic-m", "model": "claude-x",
        "status": "error"})
    step = h.exchange("sb-9", "anthropic-m", "/v1/messages", b'{"model":"claude-x"}', b"",
                      status=0)
    assert isinstance(step, Exchange)
    assert h.records[-1]["input_tokens"] is None and h.records[-1]["model"] == "claude-x"
    assert counter_value("sandbox_gateway_inference_requests_total", {
        "policy": "metered-agent", "credential": "anthropic-m", "model": "claude-x",
        "status": "error"}) == before + 1


def admin_app(h: Harness, metering: Metering | None = None) -> TestClient:
    tokens = TokenService(SigningKeys.load(h.state_dir / "signing"), h.state,
                          lambda name: [])
    return TestClient(build_admin_app(AdminContext(
        admin_token=ADMIN, tokens=tokens, policies=lambda: h.policies, readiness=_Ready(),
        metering=metering if metering is not None else h.metering, clock=lambda: NOW)))


class _Ready:
    def ready(self) -> tuple[bool, str]:
        return True, "ready"

    def degraded(self) -> list[str]:
        return []


@pytest.fixture
def usage_harness(tmp_path: Path) -> Harness:
    h = Harness(tmp_path)
    traffic = [
        ("sb-1", "openai-m", "/v1/chat/completions", b'{"model":"gpt-4o-mini"}',
         "openai_chat_stream_usage.sse", NOW - 7200),
        ("sb-1", "openai-m", "/v1/responses", b'{"model":"gpt-4.1"}',
         "openai_responses_stream.sse", NOW),
        ("sb-2", "anthropic-m", "/v1/messages", b'{"model":"claude-opus-4-1"}',
         "anthropic_messages_stream.sse", NOW),
        ("sb-2", "anthropic-m", "/v1/messages", b'{"model":"claude-opus-4-1"}',
         "openai_error_401.json", NOW),
    ]
    for sandbox, cred, path, body, name, at in traffic:
        step = h.exchange(sandbox, cred, path, body, fixture(name), now=at,
                          status=401 if "error" in name else 200)
        assert isinstance(step, Exchange)
    return h


def sums(records: list[dict[str, Any]]) -> dict[str, Any]:
    out = {"requests": len(records),
           "unknown_requests": sum(r["input_tokens"] is None for r in records)}
    for key in ("input_tokens", "output_tokens", "cached_input_tokens"):
        out[key] = sum(r[key] or 0 for r in records)
    out["cost_usd"] = sum(r["cost_usd"] or 0 for r in records)
    return out


def test_usage_endpoint_totals_equal_the_audit_records(usage_harness: Harness) -> None:
    h = usage_harness
    client = admin_app(h)
    assert client.get("/v1/usage").status_code == 401
    answer = client.get("/v1/usage", headers=AUTH).json()
    expected = sums(h.records)
    assert {k: answer["totals"][k] for k in expected if k != "cost_usd"} == {
        k: v for k, v in expected.items() if k != "cost_usd"}
    assert answer["totals"]["cost_usd"] == pytest.approx(expected["cost_usd"])
    assert answer["degraded"] is False
    assert answer["until"] == "2026-11-22T10:30:00Z"
    rows = {(r["sandbox"], r["model"]): r for r in answer["rows"]}
    assert rows[("sb-2", "claude-opus-4-1-20250805")]["input_tokens"] == 35
    assert rows[("sb-2", "claude-opus-4-1")]["unknown_requests"] == 1  # the 401
    assert rows[("sb-1", "gpt-4.1-2025-04-14")]["cost_usd"] == 0  # no price for it
    # Filters.
    only = client.get("/v1/usage?sandbox=sb-1", headers=AUTH).json()
    assert only["totals"] == pytest.approx(sums([r for r in h.records
                                                 if r["sandbox"] == "sb-1"]))
    assert {b["budget"] for b in only["budgets"]} == {"daily"}
    assert only["budgets"][0]["used"]["tokens"] == 21 + 48
    recent = client.get("/v1/usage?since=1h", headers=AUTH).json()
    assert recent["since"] == "2026-11-22T09:00:00Z"  # rounded down to the hour
    assert recent["totals"]["requests"] == 3
    iso = client.get("/v1/usage?since=2026-11-22T10:00:00Z&policy=metered-agent",
                     headers=AUTH).json()
    assert iso["totals"]["requests"] == 3 and iso["policy"] == "metered-agent"
    assert client.get("/v1/usage?policy=nope", headers=AUTH).json()["rows"] == []


@pytest.mark.parametrize(("query", "reason"), [
    ("since=yesterday", "neither an ISO 8601 time"),
    ("sandbox=a&limit=3", "unknown parameter 'limit'"),
])
def test_usage_endpoint_bad_requests(usage_harness: Harness, query: str, reason: str) -> None:
    response = admin_app(usage_harness).get(f"/v1/usage?{query}", headers=AUTH)
    assert response.status_code == 400
    assert reason in response.json()["reason"]


def test_usage_endpoint_without_metering(usage_harness: Harness, tmp_path: Path) -> None:
    tokens = TokenService(SigningKeys.load(tmp_path / "s"), MemoryState(), lambda n: [])
    client = TestClient(build_admin_app(AdminContext(
        admin_token=ADMIN, tokens=tokens, policies=lambda: usage_harness.policies,
        readiness=_Ready())))
    response = client.get("/v1/usage", headers=AUTH)
    assert response.status_code == 503
    assert response.json()["error"] == "metering_unavailable"


def test_usage_endpoint_says_degraded(tmp_path: Path) -> None:
    """A state file that cannot be written: counting goes on locally, /v1/usage says so,
    and the counts are written once it can be."""
    import asyncio
    import sqlite3

    state = SqliteState(tmp_path / "state.db", clock=lambda: NOW)
    asyncio.run(state.start())
    writable = state._conn
    state._conn = sqlite3.connect(f"file:{tmp_path / 'state.db'}?mode=ro", uri=True,
                                  isolation_level=None)  # (SQLite refuses every write)
    h = Harness(tmp_path, state)
    # (No budget: a budgeted call is decided alone only on a share of it this process
    # holds, tests/services/state/test_counters_shares.py.)
    h.policies = load_policy_texts({name: text.replace(
        "budgets:\n  - {name: daily, per: sandbox, window: 24h, tokens: 100}\n", "")
        for name, text in POLICIES.items()})
    assert not h.policies.policies["metered-agent"].budgets
    h.exchange("sb-1", "openai-m", "/v1/chat/completions", b'{"model":"gpt-4o-mini"}',
               fixture("openai_chat.json"))
    answer = admin_app(h).get("/v1/usage", headers=AUTH).json()
    assert answer["degraded"] is True
    assert answer["totals"]["input_tokens"] == 1117
    assert state.problem is not None and "readonly" in state.problem
    state._conn = writable
    state.flush()
    assert state.problem is None
    assert admin_app(h).get("/v1/usage", headers=AUTH).json()["totals"]["input_tokens"] == 1117


# --- CLI ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def admin_server(usage_harness: Harness) -> Iterator[str]:
    port = free_port()
    tokens = TokenService(SigningKeys.load(usage_harness.state_dir / "signing"),
                          usage_harness.state, lambda name: [])
    app = build_admin_app(AdminContext(
        admin_token=ADMIN, tokens=tokens, policies=lambda: usage_harness.policies,
        readiness=_Ready(), metering=usage_harness.metering, clock=lambda: NOW))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_cli_usage_table_and_json(admin_server: str, usage_harness: Harness,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["usage", "--admin", admin_server, "--token", ADMIN, "--sandbox", "sb-1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "usage from 2026-11-15T10:00:00Z to 2026-11-22T10:30:00Z"
    assert out[1].split() == ["POLICY", "SANDBOX", "CREDENTIAL", "MODEL", "REQUESTS",
                              "NO_USAGE", "INPUT", "OUTPUT", "CACHED", "COST_USD"]
    assert out[2].split() == ["metered-agent", "sb-1", "openai-m", "gpt-4.1-2025-04-14", "1",
                              "0", "37", "11", "5", "0.0000"]
    assert out[3].split()[3] == "gpt-4o-mini-2024-07-18"
    assert out[4].split() == ["TOTAL", "2", "0", "46", "23", "5", "0.0000"]
    assert any(line.strip().startswith("metered-agent/daily per sandbox 'sb-1'")
               and "tokens 69 of 100" in line and "[ok, resets 2026-11-23T00:00:00Z]" in line
               for line in out)
    assert main(["usage", "--admin", admin_server, "--token", ADMIN, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["totals"]["requests"] == len(usage_harness.records)


def test_cli_usage_token_from_config(admin_server: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    certs = tmp_path / "certs"
    certs.mkdir()
    (certs / "admin-token").write_text(ADMIN + "\n")
    port = admin_server.rsplit(":", 1)[1]
    config = tmp_path / "gateway.yaml"
    config.write_text(f'listen: {{admin: "0.0.0.0:{port}"}}\ncerts: certs\n')
    assert main(["usage", "--config", str(config), "--policy", "metered-agent"]) == 0
    assert "TOTAL" in capsys.readouterr().out


def test_cli_usage_errors(admin_server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["usage", "--admin", admin_server, "--token", "wrong"]) == 1
    assert "HTTP 401 send Authorization: Bearer <admin token>" in capsys.readouterr().err
    assert main(["usage", "--admin", admin_server, "--token", ADMIN, "--since", "x"]) == 1
    assert "HTTP 400" in capsys.readouterr().err
    closed = f"http://127.0.0.1:{free_port()}"
    assert main(["usage", "--admin", closed, "--token", ADMIN]) == 1
    assert f"cannot reach the admin API at {closed}" in capsys.readouterr().err


def test_build_metering(tmp_path: Path) -> None:
    (tmp_path / "pricing.yaml").write_text("gpt-4o*: {input: 2.5, output: 10}\n")
    cfg = load_config(None, env={"SANDBOX_GATEWAY_METERING__PRICING":
                                 str(tmp_path / "pricing.yaml"),
                                 "SANDBOX_GATEWAY_METERING__STREAM_USAGE": "false"})
    metering = build_metering(cfg, MemoryState())
    assert metering.pricing is not None and metering.stream_usage is False
    assert metering.budgets.share  # state.unavailable: serve (the default)
    refusing = load_config(None, env={"SANDBOX_GATEWAY_STATE__UNAVAILABLE": "refuse"})
    assert not build_metering(refusing, MemoryState()).budgets.share
    bad = Config(metering=MeteringConfig(pricing=tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match=r"metering\.pricing: .*cannot read"):
        build_metering(bad, MemoryState())
    policies = load_policy_texts({"p.yaml": "version: v1\nname: p\nbudgets:\n  - {name: b, "
                                  "per: policy, window: 1h, cost_usd: 5}\n"})
    assert Metering(MemoryState()).problems(policies) == [
        'p.yaml:4: budget "b" sets cost_usd but metering.pricing is not configured, so costs '
        "are unknown and every inference call it counts is refused (metering_unavailable); set "
        "metering.pricing in the gateway config"]


def test_cli_usage_shows_what_running_calls_hold() -> None:
    from gateway.cli.usage import _usage_lines

    report = {"since": "a", "until": "b", "rows": [], "totals": {
        "requests": 0, "unknown_requests": 0, "input_tokens": 0, "output_tokens": 0,
        "cached_input_tokens": 0, "cost_usd": None}, "budgets": [{
            "policy": "p", "budget": "daily", "per": "sandbox", "subject": "sb",
            "window": "24h", "window_start": "s", "resets_at": "r", "exceeded": False,
            "used": {"tokens": 1200, "requests": 3, "cost_usd": 0.5},
            "reserved": {"tokens": 4196, "cost_usd": 0.25},
            "limits": {"tokens": 10000, "cost_usd": 2}}]}
    line = next(x for x in _usage_lines(report) if "p/daily" in x)
    assert "tokens 1,200 (+4,196 reserved) of 10,000" in line
    assert "cost_usd 0.50 (+0.25 reserved) of 2.00" in line
