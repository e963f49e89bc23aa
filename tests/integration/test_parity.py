"""Parity: one table of cases through every engine, the same answer and audit line each.

Engines: `h1` (the front door and the HTTP/1 engine, the default), `mitmproxy`
(`network.intercept: mitmproxy`, mitmproxy serves everything), `h2` (the default
gateway, an HTTP/2-only client: handed to mitmproxy with the admitted client), and
`transparent` (a sandbox network namespace redirected into a gateway process; see
test_parity_transparent.py). Every case states what the client sees and the audit
line's decision fields; the suite asserts both, and that every engine wrote the same
decision fields for the same case. Findings of the enforcement-core issue carry their
number (F1 … F12).
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers.gateway import GatewayThread
from helpers.mcp_consent import consenting
from helpers.parity import SharedDecisions, Spec, run, shared_decisions
from helpers.parity_cases import (
    CASES,
    ENGINES,
    POLICIES,
    SECRETS,
    Case,
    build_spec,
    deciding_line,
    decision_fields,
    new_lines,
    primes,
)
from helpers.tls import LocalCA
from helpers.upstream import Upstream

from gateway.core.client import Client
from gateway.net.resolver import StaticResolver

# -- the in-process engines ----------------------------------------------------------------


@pytest.fixture(scope="module")
def parity_secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("parity") / "secrets.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in SECRETS.items()))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest, parity_secrets: Path, upstream: Upstream,
           test_ca: LocalCA, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, GatewayThread]]:
    """One gateway per engine for every case (a gateway's start and stop took longer than
    most cases): each case's token is a sandbox of its own (`_token`), so budgets,
    connection limits and minted values are its own as on a fresh gateway, and each reads
    only the audit lines written after it began (`new_lines`). The transparent table
    (test_parity_transparent.py) shares one gateway the same way."""
    name = request.param
    names = ["allowed.test", "other.test", "unbound.test", "api.openai.com", "minted.test",
             "mintfail.test", "budget.test", "metered.test", "sigv4.test"]  # (the upstream's
    # certificate names)
    work = tmp_path_factory.mktemp(f"parity-{name}")
    (work / "policies").mkdir()
    for file, text in POLICIES.items():
        (work / "policies" / file).write_text(text)
    gw = GatewayThread(work, {
        "secrets": {"store": "file", "path": str(parity_secrets)},
        "network": {"upstream_ca": str(test_ca.cert_path),
                    "intercept": "mitmproxy" if name == "mitmproxy" else "fast",
                    "resolve": {n: f"127.0.0.1:{upstream.port}" for n in names}},
    }, resolver=StaticResolver({}))
    try:
        yield name, gw
    finally:
        gw.stop()


def _token(gw: GatewayThread, kind: str, policy: str = "agent",
           sandbox: str = "sandbox-1") -> str:
    if kind == "expired":
        service = gw.gateway.tokens
        real = service.clock
        service.clock = lambda: real() - 3600
        try:
            return gw.mint("agent", sandbox, ttl=60)
        finally:
            service.clock = real
    token = gw.mint(policy, sandbox)
    if kind == "revoked":
        jti = gw.gateway.tokens.verify(token).jti
        gw.call(gw.gateway.state.revoke(jti, 1e12))
    return token




@pytest.fixture(scope="session")
def decisions(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> SharedDecisions:
    """Each case's decision fields on every engine, across the run's processes."""
    return shared_decisions(request.config, tmp_path_factory.getbasetemp(), "parity")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(engine: tuple[str, GatewayThread], case: Case, decisions: SharedDecisions,
              upstream: Upstream, test_ca: LocalCA) -> None:
    name, gw = engine
    if name not in case.engines:
        pytest.skip(f"{case.name}: not an {name} shape")
    # A sandbox of its own on the engine's gateway (budgets, connection limits), as a
    # fresh gateway gave each case; a case whose line names it (NAMED) gets that one.
    sandbox = str(case.audit.get("sandbox") or f"case-{CASES.index(case) + 1}")
    token = _token(gw, case.token, case.policy, sandbox)
    for primer in primes(case):  # fetch or mint the value once, through a swap
        with _consent(primer, gw, upstream, test_ca):
            run(_proxy_spec(primer, gw, token, test_ca, name, sandbox))
    gw.settle()  # (a primer's lines all written: none counted as the case's)
    before_lines = len(gw.audit.records())
    before_seen = len(upstream.requests)
    with _consent(case, gw, upstream, test_ca):
        result = run(_proxy_spec(case, gw, token, test_ca, name, sandbox))
    stage, status, code = case.see
    if case.streamed and name == "mitmproxy":
        stage, status, code = "closed", None, None
    assert (result.stage, result.status, result.code) == (stage, status, code), result
    lines = new_lines(gw.audit.records, before_lines, case.lines, gw.settle)
    assert len(lines) == case.lines, lines  # one line per exchange, never a second
    line = deciding_line(lines)
    for key, want in case.audit.items():
        assert line[key] == want, (key, line)
    # The engine that was meant to serve it did (a fall-back to another fails the row).
    assert line["engine"] == expected_engine(name, line), (name, line["engine"], line)
    if case.check is not None:
        case.check(result, upstream.requests[before_seen:])
    seen = decisions.record(case.name, name, decision_fields(line))
    # The same decision on every engine that ran the case (in whichever process).
    assert len({json.dumps(v, sort_keys=True) for v in seen.values()}) == 1, seen


LATE = 0.3  # seconds: past the fixed 0.1 s the table once waited after each case


def test_a_line_a_connection_writes_late_is_still_counted(
        engine: tuple[str, GatewayThread], test_ca: LocalCA,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The table's "never a second line" can fail on a line that comes late: a gateway
    mutated so that a connection's end writes one more line `LATE` s after the client
    closed (and only then counts the connection closed) has `new_lines` return that
    line too, on every engine, for a refusal at CONNECT. The table waits for the
    connections' end (`GatewayThread.settle`), not a fixed time."""
    name, gw = engine
    gate, loop = gw.gateway.gate, gw.loop
    real = gate.closed
    ending: set[int] = set()
    written: list[dict[str, Any]] = []

    def closed_late(client: Client) -> None:  # (called on the gateway's loop)
        if id(client) in ending:
            return  # (an engine may call it twice: one late line, one real end)
        ending.add(id(client))

        def end() -> None:
            line = {**gw.audit.records()[-1], "engine": "late-mutation"}
            written.append(line)
            gw.gateway.auditor.write(line)
            real(client)
        loop.call_later(LATE, end)

    case = next(c for c in CASES if c.name == "deny host")
    token = _token(gw, case.token, case.policy, "late-line")
    gw.settle()
    monkeypatch.setattr(gate, "closed", closed_late)
    before = len(gw.audit.records())
    started = time.monotonic()
    result = run(_proxy_spec(case, gw, token, test_ca, name, "late-line"))
    assert (result.stage, result.status, result.code) == case.see, result
    lines = new_lines(gw.audit.records, before, case.lines, gw.settle)
    assert time.monotonic() - started >= LATE
    assert len(written) == 1 and len(lines) == case.lines + 1, lines  # (the table fails)
    assert lines[-1]["engine"] == "late-mutation", lines


def _consent(case: Case, gw: GatewayThread, upstream: Upstream,
             test_ca: LocalCA) -> contextlib.AbstractContextManager[None]:
    """A person completing the MCP OAuth consent the case's request is held for."""
    if not case.consent:
        return contextlib.nullcontext()
    return consenting(gw, upstream.port, test_ca.cert_path)


def expected_engine(fixture: str, line: dict[str, Any]) -> str:
    """The engine whose audit line a case must end with: with `network.intercept:
    mitmproxy`, mitmproxy for everything; otherwise the front door for what is decided
    at CONNECT, the splice for a passthrough tunnel, and for a request the HTTP/1 engine
    (or mitmproxy, an HTTP/2 client's)."""
    if fixture == "mitmproxy":
        return "mitmproxy"
    if line["path_taken"] == "passthrough":
        return "splice"
    if line["method"] == "CONNECT":
        return "frontdoor"
    return "h1" if fixture == "h1" else "mitmproxy"


def _proxy_spec(case: Case, gw: GatewayThread, token: str, test_ca: LocalCA,
                engine: str, sandbox: str) -> Spec:
    assert gw.gateway.proxy_address is not None
    cred = base64.b64encode(f"{sandbox}:{token}".encode()).decode()
    cafile = str(test_ca.cert_path) if case.extra.get("upstream_ca") else str(gw.ca_cert)
    spec = build_spec(case, token, proxy=gw.gateway.proxy_address,
                      proxy_auth=f"Basic {cred}", cafile=cafile)
    return replace(spec, h2=engine == "h2")
