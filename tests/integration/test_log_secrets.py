"""Secrets never reach the gateway's log: a real `sandbox-gateway run` process (its own
logging set-up, at debug level), an upstream that answers malformed HTTP quoting the key
it was sent (raw, base64, hex, URL-encoded; in a status line, a header line, a
Transfer-Encoding, a chunk size, or no HTTP at all), for a stored key and a minted
token, and a sandbox whose malformed requests quote its own token; on every engine:
the HTTP/1 engine, mitmproxy (`network.intercept: mitmproxy`) and an HTTP/2 client
(the transparent door: test_parity_transparent.py). The whole stderr and the audit
file are then searched for the key, the minted token, the OAuth client secret and the
gateway token in every encoding the leak scanner knows."""

from __future__ import annotations

import base64
import json
import logging
import signal
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.gateway import GatewayFactory
from helpers.parity import Result, Spec, run
from helpers.process import GatewayProcess, start_gateway
from helpers.tls import LocalCA
from helpers.upstream import ENCODINGS, MALFORMED, MINT_CLIENT, MINT_SECRET, MINTED, Upstream

from gateway.core.leak_forms import sensitive_markers, token_markers
from gateway.core.leaks import LeakScan
from gateway.observability.logs import REDACTED, REDACTION

KEY = "sk-logtest-real-key-0123456789abcdef"
POLICY = f"""
version: v1
name: agent
egress:
  - host: allowed.test
  - host: api.openai.com
    credential: openai
  - host: minted.test
    credential: minted
credentials:
  openai: {{preset: openai, secret: openai-api-key}}
  minted:
    type: oauth2-client-credentials
    token_url: https://allowed.test/oauth2/token
    client_id: {MINT_CLIENT}
    client_secret: client-secret
    hosts: [minted.test]
"""
NAMES = ("allowed.test", "api.openai.com", "minted.test")
# engine -> (network.intercept, an HTTP/2 client): h2 is the default gateway handing an
# HTTP/2 client to mitmproxy.
ENGINES = {"h1": ("fast", False), "mitmproxy": ("mitmproxy", False), "h2": ("fast", True)}


@pytest.fixture(params=list(ENGINES))
def engine(request: pytest.FixtureRequest, tmp_path: Path, upstream: Upstream,
           test_ca: LocalCA) -> Iterator[tuple[bool, GatewayProcess]]:
    """A gateway process for one engine: (HTTP/2 client?, the process)."""
    intercept, h2 = ENGINES[request.param]
    workdir = tmp_path / "gw"
    workdir.mkdir()
    secrets = workdir / "secrets.yaml"
    secrets.write_text(f"openai-api-key: {KEY}\nclient-secret: {MINT_SECRET}\n")
    secrets.chmod(0o600)
    gw = start_gateway(workdir, dict.fromkeys(NAMES, upstream.port), test_ca, policy=POLICY,
                       extra={"log_level": "debug", "workers": 1,
                              "secrets": {"store": "file", "path": str(secrets)},
                              "network": {"intercept": intercept}},
                       log=workdir / "stderr.log")
    try:
        yield h2, gw
    finally:
        gw.stop()


def _spec(gw: GatewayProcess, token: str, h2: bool, host: str, target: str,
          headers: list[tuple[str, str]]) -> Spec:
    cred = base64.b64encode(f"sbx-1:{token}".encode()).decode()
    return Spec(host=host, target=target, headers=headers, proxy=("127.0.0.1", gw.proxy),
                proxy_auth=f"Basic {cred}", cafile=str(gw.workdir / "certs" / "ca.crt"),
                h2=h2, timeout=10)


def _leaks(text: str, token: str) -> str | None:
    scan = LeakScan(token_markers(token, "sandbox-gateway"),
                    [m for v in (KEY, MINTED, MINT_SECRET) for m in sensitive_markers(v.encode())])
    return scan.find(text.encode("utf-8", "surrogateescape"))


def test_no_secret_in_the_log(engine: tuple[bool, GatewayProcess], upstream: Upstream) -> None:
    h2, gw = engine
    token = gw.token()
    seen_before = len(upstream.requests)
    results: list[tuple[str, Result]] = []
    for host in ("api.openai.com", "minted.test"):
        for shape in MALFORMED:
            for enc in ENCODINGS:
                spec = _spec(gw, token, h2, host=host,
                             target=f"/malformed/{shape}/Authorization?enc={enc}",
                             headers=[("Authorization", f"Bearer {token}")])
                results.append((f"{host} {shape} {enc}", run(spec)))
    if not h2:  # a sandbox's malformed requests, quoting its token
        for headers, target in (([(f"X-Bad {token}", "1")], "/x"), ([], f"/x {token}")):
            spec = _spec(gw, token, h2, host="api.openai.com", target=target, headers=headers)
            results.append(("bad request", run(spec)))
    gw.proc.send_signal(signal.SIGTERM)
    log = gw.stderr()
    audit = json.dumps(gw.audit_lines())

    # The upstream did see (and echo) the real values: the test tests something.
    seen = upstream.requests[seen_before:]
    assert any(r.headers.get("authorization") == f"Bearer {KEY}" for r in seen)
    assert any(r.headers.get("authorization") == f"Bearer {MINTED}" for r in seen)
    for name, result in results:
        assert result.stage in ("response", "closed"), (name, result)
        if result.stage == "response":
            assert result.status in (200, 400, 502), (name, result)
            assert _leaks(result.body + json.dumps(result.headers), token) is None, name
    for text, where in ((log, "stderr"), (audit, "audit")):
        found = _leaks(text, token)
        assert found is None, f"a {found} in the gateway's {where}:\n{text[-5000:]}"
        assert KEY not in text and MINTED not in text and token not in text
    # The malformed answers were logged, as their words only.
    assert "failed (protocol)" in log or "mitmproxy answered 502" in log or \
        "failed (connect)" in log, log[-3000:]
    assert "[quoted data withheld]" in log, log[-3000:]


def test_the_running_gateway_registers_what_it_fetches(make_gateway: GatewayFactory,
                                                       tmp_path: Path) -> None:
    """In-process: uvicorn's handlers carry the redaction once the gateway started; a key
    the gateway fetched, a minted token, the OAuth client secret and a token with its
    header cut off are redacted from then on."""
    secrets = tmp_path / "secrets.yaml"
    secrets.write_text(f"openai-api-key: {KEY}\nclient-secret: {MINT_SECRET}\n")
    secrets.chmod(0o600)
    gw = make_gateway({"agent.yaml": POLICY},
                      config={"secrets": {"store": "file", "path": str(secrets)}})
    assert logging.getLogger("uvicorn").handlers
    assert all(REDACTION in h.filters for h in logging.getLogger("uvicorn").handlers)
    token = gw.mint("agent")
    assert REDACTION.redact(KEY) == KEY  # not fetched yet: unknown
    for host in ("api.openai.com", "minted.test"):
        with httpx.Client(proxy=gw.proxy_url(token), timeout=10,
                          verify=ssl.create_default_context(cafile=gw.ca_cert)) as c:
            assert c.get(f"https://{host}/x",
                         headers={"Authorization": f"Bearer {token}"}).status_code == 200
    for value in (KEY, MINTED, MINT_SECRET, token, token.split(".", 1)[1]):
        assert REDACTION.redact(f"x {value} y") == f"x {REDACTED} y", value
