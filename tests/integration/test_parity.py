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
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers.gateway import GatewayFactory, GatewayThread
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

from gateway.net.resolver import StaticResolver

# -- the in-process engines ----------------------------------------------------------------


@pytest.fixture(scope="module")
def parity_secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("parity") / "secrets.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in SECRETS.items()))
    path.chmod(0o600)
    return path


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest, make_gateway: GatewayFactory,
           parity_secrets: Path, upstream: Upstream) -> tuple[str, GatewayThread]:
    name = request.param
    names = ["allowed.test", "other.test", "unbound.test", "api.openai.com", "minted.test",
             "mintfail.test", "budget.test", "metered.test", "sigv4.test"]  # (the upstream's
    # certificate names)
    gw = make_gateway(dict(POLICIES), config={
        "secrets": {"store": "file", "path": str(parity_secrets)},
        "network": {"intercept": "mitmproxy" if name == "mitmproxy" else "fast",
                    "resolve": {n: f"127.0.0.1:{upstream.port}" for n in names}},
    }, resolver=StaticResolver({}))
    return name, gw


def _token(gw: GatewayThread, kind: str, policy: str = "agent") -> str:
    if kind == "expired":
        service = gw.gateway.tokens
        real = service.clock
        service.clock = lambda: real() - 3600
        try:
            return gw.mint("agent", ttl=60)
        finally:
            service.clock = real
    token = gw.mint(policy)
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
    token = _token(gw, case.token, case.policy)
    for primer in primes(case):  # fetch or mint the value once, through a swap
        with _consent(primer, gw, upstream, test_ca):
            run(_proxy_spec(primer, gw, token, test_ca, name))
    before_lines = len(gw.audit.records())
    before_seen = len(upstream.requests)
    with _consent(case, gw, upstream, test_ca):
        result = run(_proxy_spec(case, gw, token, test_ca, name))
    stage, status, code = case.see
    if case.streamed and name in ("mitmproxy", "h2"):
        stage, status, code = "closed", None, None
    assert (result.stage, result.status, result.code) == (stage, status, code), result
    lines = new_lines(gw.audit.records, before_lines, case.lines)
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
                engine: str) -> Spec:
    assert gw.gateway.proxy_address is not None
    cred = base64.b64encode(f"sandbox-1:{token}".encode()).decode()
    cafile = str(test_ca.cert_path) if case.extra.get("upstream_ca") else str(gw.ca_cert)
    spec = build_spec(case, token, proxy=gw.gateway.proxy_address,
                      proxy_auth=f"Basic {cred}", cafile=cafile)
    return replace(spec, h2=engine == "h2")
