"""Parity, transparent mode: the parity table through a sandbox network namespace
redirected into a gateway process (iptables REDIRECT, SO_ORIGINAL_DST), served by the
HTTP/1 engine and, with `network.intercept: mitmproxy`, by mitmproxy (which refused
every intercepted request until the gate pinned the original address too: mitmproxy
dials a redirected connection by its address, the gate had pinned its name). The sandbox is
registered by its address (transparent mode has no proxy credentials); everything else
is the table's: the same answers, the same audit decisions. What cannot apply here is
skipped (no CONNECT: no port or token refusals at a proxy; a refusal before TLS reaches
the client as a failed handshake, not an HTTP answer)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers.netns import UPSTREAM_IP, Lab, transparent_lab, unavailable
from helpers.parity import Result
from helpers.parity_cases import (
    CASES,
    KEY,
    POLICY,
    SECRETS,
    Case,
    build_spec,
    deciding_line,
    new_lines,
    primes,
)
from helpers.upstream import ENCODINGS, MALFORMED, MINT_SECRET, MINTED

from gateway.core.leak_forms import sensitive_markers, token_markers
from gateway.core.leaks import LeakScan

pytestmark = pytest.mark.netns

NAMES = ["allowed.test", "other.test", "unbound.test", "api.openai.com", "minted.test",
         "mintfail.test", "budget.test", "metered.test", "sigv4.test"]
APPLICABLE = [c for c in CASES if c.transparent is None or c.transparent[0] != "skip"]
ENGINE = {"fast": "h1", "mitmproxy": "mitmproxy"}  # network.intercept -> the table's engine


@pytest.fixture(scope="module", params=list(ENGINE))
def parity_lab(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    why = unavailable()
    if why:
        pytest.fail(why)
    workdir: Path = tmp_path_factory.mktemp("parity-lab")
    with transparent_lab(workdir, policy=POLICY, names=NAMES,
                         secrets=SECRETS, log_level="debug", intercept=request.param,
                         resolve={n: f"{UPSTREAM_IP}:443" for n in NAMES}) as lab:
        lab.register("sandbox-1")
        lab.engine = ENGINE[request.param]  # type: ignore[attr-defined]
        yield lab


def _seen(lab: Lab, before: int) -> list[Any]:
    return [SimpleNamespace(method=r["method"], path=r["path"], headers=r["headers"],
                            body=r["body"].encode("latin-1"))
            for r in lab.upstream_seen()[before:]]


@pytest.mark.parametrize("case", APPLICABLE, ids=[c.name for c in APPLICABLE])
def test_case_transparent(parity_lab: Lab, case: Case) -> None:
    lab = parity_lab
    engine: str = lab.engine  # type: ignore[attr-defined]
    if engine not in case.engines:
        pytest.skip(f"{case.name}: not an {engine} shape")
    token = lab.mint("sandbox-1")
    primed = len(lab.audit())
    for primer in primes(case):
        lab.sandbox_client(_spec(lab, primer, token))
    if primes(case):  # (their lines written before the case's are counted)
        new_lines(lab.audit, primed, sum(p.lines for p in primes(case)), lab.settle)
    before_lines, before_seen = len(lab.audit()), len(lab.upstream_seen())
    got = Result(**lab.sandbox_client(_spec(lab, case, token)))
    stage, status, code = case.transparent or case.see
    if case.streamed:  # the HTTP/1 engine holds the body: it answers; mitmproxy cuts
        stage, status, code = case.see if engine == "h1" else ("closed", None, None)
    assert (got.stage, got.status, got.code) == (stage, status, code), got
    lines = new_lines(lab.audit, before_lines, case.lines, lab.settle)
    assert len(lines) == case.lines, lines  # one line per exchange, never a second
    line = deciding_line(lines)
    # The engine meant to serve it did: passthrough the splice (mitmproxy's own under
    # `intercept: mitmproxy`), a request the engine, what has none the transparent door
    # or the engine's head parser.
    if line["path_taken"] == "passthrough":
        assert line["engine"] == ("splice" if engine == "h1" else engine), line
    elif line["method"] is not None:
        assert line["engine"] == engine, line
    else:
        assert line["engine"] in ("transparent", engine), line
    for key, want in case.audit.items():
        if key == "method" and want == "CONNECT":
            continue  # no CONNECT in transparent mode: the connection itself is decided
        assert line[key] == want, (key, line)
    assert line["listener"] == "transparent"
    if case.check is not None:
        case.check(got, _seen(lab, before_seen))
    assert lab.canary_hits() == 0


def _spec(lab: Lab, case: Case, token: str) -> dict[str, Any]:
    spec = build_spec(case, token, cafile=str(lab.gateway_ca), proxy=None,
                      proxy_auth=None, plain_proxy=False)
    cafile = str(lab.ca.cert_path) if case.extra.get("upstream_ca") else str(lab.gateway_ca)
    raw = json.loads(json.dumps(spec.__dict__))
    raw.update(connect_to=[_address(case), spec.port], cafile=cafile)
    return raw


def _address(case: Case) -> str:
    host = case.spec["host"]
    return host if host[0].isdigit() else UPSTREAM_IP


KEEPALIVE = r"""
import socket, sys
s = socket.create_connection((sys.argv[1], 80), timeout=10)
out = []
for host in ("allowed.test", "unbound.test"):
    s.sendall(f"GET /v HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = [int(x.split(b":")[1]) for x in head.split(b"\r\n")
              if x.lower().startswith(b"content-length")]
    while length and len(rest) < length[0]:
        rest += s.recv(65536)
    out.append(head.split(b"\r\n")[0].decode())
print("|".join(out))
"""


def test_plain_http_keep_alive_cannot_switch_hosts(parity_lab: Lab) -> None:
    """Finding 5: transparent plain HTTP on a host-only rule went through unchecked, so a
    later request on the same connection could name another virtual host. Cleartext
    is always inspected now: every request's Host must be the connection's."""
    import subprocess
    import sys

    before = len(parity_lab.audit())
    out = subprocess.run(["ip", "netns", "exec", parity_lab.sbx_ns, sys.executable, "-c",
                          KEEPALIVE, UPSTREAM_IP], capture_output=True, text=True, timeout=30)
    first, second = out.stdout.strip().split("|")
    assert first.startswith("HTTP/1.1 200"), out
    assert second.startswith("HTTP/1.1 403 host_mismatch"), out
    parity_lab.settle()  # (the connection's lines all written)
    lines = parity_lab.audit()[before:]
    assert [r["error"] for r in lines] == [None, "host_mismatch"]
    assert all(r["path_taken"] in ("intercept", None) for r in lines)


def test_no_secret_in_the_gateway_log(parity_lab: Lab) -> None:
    """Log hygiene on the transparent door (the other engines: test_log_secrets.py): an
    upstream answering malformed HTTP that quotes the key or the minted token it was
    sent (raw, base64, hex, URL-encoded), and malformed requests quoting the sandbox's
    token; the gateway's whole stderr (debug level) and audit file hold none of them,
    in any encoding the leak scanner knows."""
    lab = parity_lab
    token = lab.mint("sandbox-1")
    base = {"port": 443, "connect_to": [UPSTREAM_IP, 443], "cafile": str(lab.gateway_ca),
            "headers": [["Authorization", f"Bearer {token}"]]}
    specs = [{**base, "host": host, "target": f"/malformed/{shape}/Authorization?enc={enc}"}
             for host in ("api.openai.com", "minted.test") for shape in MALFORMED
             for enc in ENCODINGS]
    specs += [{**base, "host": "api.openai.com", "target": "/x",
               "headers": [*base["headers"], [f"X-Bad {token}", "1"]]},
              {**base, "host": "api.openai.com", "target": f"/x {token}"}]
    results = lab.sandbox_client(specs)
    assert [r["status"] for r in results[:5]] == [502] * 5, results[:5]
    seen = [r["headers"].get("authorization") for r in lab.upstream_seen()]
    assert f"Bearer {KEY}" in seen and f"Bearer {MINTED}" in seen
    scan = LeakScan(token_markers(token, "sandbox-gateway"),
                    [m for v in (KEY, MINTED, MINT_SECRET) for m in sensitive_markers(v.encode())])
    for text in (lab.gateway_log, json.dumps(lab.audit()), json.dumps(results)):
        assert scan.find(text.encode("utf-8", "surrogateescape")) is None, text[-5000:]
        assert KEY not in text and MINTED not in text and token not in text
    assert "[quoted data withheld]" in lab.gateway_log
