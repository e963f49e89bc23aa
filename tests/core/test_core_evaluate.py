"""The decision pipeline (gateway/core/evaluate.py): every caller gives the proxy's verdict.

The parity table (tests/helpers/parity_cases.py) says what every engine answers each
case; tests/integration/test_parity.py proves the running proxy does. Here the same
cases go through the callers that decide without a connection — ``evaluate``,
``policy explain`` (with the destination check), ``policy test`` (a YAML case file, as
a user writes it) and ``policy diff --replay`` (an audit line, as the gateway writes it)
— and each must give the proxy's verdict where that verdict is theirs to give: the
policy, the credential's static checks, the metering step and (explain) the
destination. What depends on the bytes of a connection (tokens, leaks, heads, upstream
answers) or on recorded usage is the proxy's alone: there they must answer allow.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import zlib
from typing import Any

import pytest
import yaml
from helpers.parity_cases import _PROSE as PROSE
from helpers.parity_cases import _PROSE_END as PROSE_END
from helpers.parity_cases import CASES, PAD, POLICIES, Case, _fill, _filler, substitutions

from gateway.core import mcp
from gateway.core.addresses import AddressPolicy
from gateway.core.body_stage import NO_CALLS, mcp_stage
from gateway.core.dlp.decoding import decode_content
from gateway.core.evaluate import (
    UNSEEN,
    evaluate,
    name_allowed,
    request_for,
    route,
)
from gateway.core.metering.models import named_models
from gateway.core.policy import PolicySet, Request
from gateway.core.target import url_target
from gateway.net.resolver import DestinationGuard, StaticResolver, parse_overrides
from gateway.observability.metrics import REGISTRY
from gateway.services.dlp.detectors import for_tools
from gateway.services.metering import static_metering
from gateway.services.policy import load_policy_texts
from gateway.services.policy.replay import replay
from gateway.services.policy.testing import parse_cases, run_case
from gateway.tools.explain import explain_request

# The proxy's refusal codes each caller decides (every other code is the proxy's alone).
PIPELINE = {"policy_denied", "credential_requires_tls", "model_not_allowed",
            "metering_unavailable", "minted_secret_refused", "mcp_denied", "secret_detected"}
DESTINATION = {"forbidden_destination", "unresolvable"}
# An audit line carries the models a request reached and the MCP calls it sent, not the
# body: replay cannot see what only the body's shape says (a call no usage can be read
# from), nor a body refused unread (no model or call read: `_audit_line`).
REPLAY_BLIND = {"metering_unavailable", "secret_detected"}  # (no body, no headers)
NAMES = ["allowed.test", "other.test", "unbound.test", "api.openai.com", "minted.test",
         "mintfail.test", "budget.test", "metered.test", "sigv4.test"]
TOKEN = "sgw_eyJhbGciOiJFZERTQSJ9.eyJzdWIiOiJzYW5kYm94LTEifQ.c2lnbmF0dXJl"  # (shape only)


@pytest.fixture(scope="module")
def policy_set() -> PolicySet:
    return load_policy_texts({f"policies/{name}": text for name, text in POLICIES.items()})


def _request(case: Case) -> tuple[str, str, bytes]:
    """(method, URL, body as the provider reads it) of a parity case's request."""
    spec = {k: _fill(v, substitutions(TOKEN)) for k, v in case.spec.items()}
    tls = spec.get("tls", True)
    scheme = "https" if tls else "http"
    port = spec.get("port", 443 if tls else 80)
    target = spec.get("target", "/")
    if spec.get("plain_proxy"):
        url = target
    else:
        path = target if target.startswith("/") else url_target(target).path
        url = f"{scheme}://{spec['host']}:{port}{path}"
    body = spec.get("body")
    raw = base64.b64decode(body) if body is not None else b""
    codings = [v for k, v in spec.get("headers", []) if k.lower() == "content-encoding"]
    if "deflate" in codings:  # (the metering step reads a body decoded)
        raw = zlib.decompressobj().decompress(raw)
    elif codings:
        raw = decode_content(raw, ", ".join(codings), 1 << 30)
    return spec.get("method", "GET").upper(), url, raw


# Rows about what one engine cannot hold (a body of unknown length on mitmproxy): the
# pipeline is given the body whole, as the HTTP/1 engine holds it.
HELD_WHOLE = {"MCP: a chunked call mitmproxy cannot hold is refused"}
# Rows refused by a decision the client sees answered through the upstream (an MCP call of
# the older SSE transport, relayed as a ping): the audit line names the refusal.
RELAYED = {"MCP: a refused call of the older SSE transport goes as a ping"}


# Rows whose credential is where only the proxy reads it (evaluate has no headers, no
# trailers, no WebSocket messages): `dlp_stage` reads the request line and a body held whole (a form
# is a form by its Content-Type, a header: read as text there, its `%67` stays; a charset
# is a header's too).
PROXY_READS = {"DLP: a credential in a header", "DLP: a credential in a WebSocket message",
               "DLP: a credential JSON-escaped in a header's JSON value",
               "DLP: a credential in a trailer",
               # (gRPC is known by its Content-Type, a header's)
               "DLP: a credential in a compressed gRPC message",
               "DLP: a credential in a compressed gRPC-Web message in its text form",
               # (the proxy undoes the coding: one it cannot is a bad request)
               "a deflate body with bytes after its end is refused unread",
               "DLP: a credential in an absolute-form plain HTTP request",
               "DLP: a credential percent-encoded in a streamed form body",
               "DLP: a credential in UTF-16 big-endian, its charset naming no byte order",
               "DLP: a credential quoted-printable in a multipart part",  # (its boundary
               "DLP: a credential in a gzip part of a streamed multipart body"}  # a header's)


# Rows whose body is bytes that are no UTF-8 text (a gzip part), which a policy test
# case (YAML) cannot hold.
BINARY = {"DLP: a credential in a gzip part of a streamed multipart body",
          "DLP: a credential in a .env of a zip a streamed upload form sends",
          "DLP: a credential in a .env of a zip after an image's bytes",
          "DLP: a credential in a .env of a zip after an image's bytes, streamed",
          "F8 token in a .env of a zip after an image's bytes",
          "F8 token in a .env of a zip after an image's bytes, streamed",
          "F8 token in a compressed gRPC message",
          "F8 token in a compressed gRPC message, gRPC the second Content-Type",
          "DLP: a credential in a compressed gRPC message",
          "F8 token committed to a file in a git push",
          "F8 token committed to a file in a git push typed as something else",
          "DLP: a credential committed to a file in a git push with no Content-Type",
          "DLP: a credential committed to a file in a git push",
          "F8 token in a .env of an uploaded .tar.gz",
          "DLP: a credential in a .env of an uploaded zip",
          "DLP: a credential in a .env of a streamed .tar.gz upload",
          "F8 token in a .env of a zip an upload form sends",
          "F8 token in a .env of a zip a streamed upload form sends",
          "F8 token in an uploaded pzstd-compressed file",
          "DLP: a credential in an uploaded pzstd-compressed file"}


# Rows whose base64 run is of an image 1.5 MB long before its zip (the run is what a
# stream follows; shortened it would test nothing).
LONG_RUNS = {"DLP: a credential in an image that is also a zip, sent in a JSON string, streamed",
             "F8 token in an image that is also a zip, sent in a JSON string, streamed"}
# Rows whose body holds a token the gateway issued: the proxy's leak guard refuses it
# first (`exfiltration_blocked`: only the proxy knows the tokens it issued); the tools,
# not knowing it, read a JWT, which the rule's `jwt` detector refuses (`secret_detected`).
LEAK_FIRST = {"DLP: a gateway token after 2 MiB of prose in a streamed body"}


def _expected(case: Case, codes: set[str]) -> str | None:
    if case.name in HELD_WHOLE or case.name in PROXY_READS:
        return None
    if case.name in LEAK_FIRST:
        return "secret_detected" if "secret_detected" in codes else None
    code = case.audit.get("error") if case.name in RELAYED else case.see[2]
    return code if code in codes else None


def _got(result: str, error: str | None) -> str | None:
    return error if result == "deny" else None


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_evaluate_gives_the_proxys_verdict(policy_set: PolicySet, case: Case) -> None:
    method, url, body = _request(case)
    policy = policy_set.policies[case.policy]
    verdict = evaluate(policy_set, policy, request_for(method, url), body=body,
                       metering=static_metering(), detectors=for_tools())
    assert _got(verdict.result, verdict.error) == _expected(case, PIPELINE), verdict.reason
    # The tunnel: refused at CONNECT exactly where the proxy refuses it there.
    if not case.spec.get("plain_proxy"):
        tunnel = request_for("CONNECT", url)
        connect = evaluate(policy_set, policy, tunnel)
        want = _expected(case, PIPELINE) if case.see[0] == "connect" else None
        assert _got(connect.result, connect.error) == want, connect.reason


def _guard() -> DestinationGuard:
    """The gateway's destination check as the parity gateway is configured: the test
    names resolve by `network.resolve` to loopback, nothing else resolves."""
    return DestinationGuard(AddressPolicy(), StaticResolver({}),
                            overrides=parse_overrides({n: "127.0.0.1:9" for n in NAMES}))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_explain_gives_the_proxys_verdict(policy_set: PolicySet, case: Case) -> None:
    method, url, body = _request(case)
    answer = asyncio.run(explain_request(policy_set, case.policy, method, url, _guard(), body))
    assert _got(answer.result, answer.error) == _expected(case, PIPELINE | DESTINATION), \
        answer.reason
    assert answer.metered


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_policy_test_gives_the_proxys_verdict(policy_set: PolicySet, case: Case) -> None:
    method, url, body = _request(case)
    if case.name in BINARY:
        pytest.skip("a body of bytes that are no text: a policy test case's body is text")
    if case.name in LONG_RUNS:
        pytest.skip("a 2 MB run no shortening keeps the reading of (the YAML loader: "
                    "20-36 s); evaluate decides it whole above")
    code = _expected(case, PIPELINE)
    # (the 2 MiB pad, there for mitmproxy's own limit, and the 2 MiB of prose or random
    # words, there for a streaming engine's chunks, are as good short: the YAML case
    # loader reads every character with its line numbers, 20-36 s a case; `evaluate`
    # decides the bodies whole above, test_evaluate_gives_the_proxys_verdict)
    text = body.decode().replace(PAD, "x" * 1024).replace(PAD[:-20], "x" * 1024)
    text = text.replace(_filler(2 << 20), _filler(1024)).replace(
        PAD.encode("utf-16-le").decode(), ("x" * 1024).encode("utf-16-le").decode())
    text = text.replace(PROSE, PROSE[:1040]).replace(PROSE_END, PROSE_END[:1008])
    entry: dict[str, Any] = {"name": case.name, "policy": case.policy, "method": method,
                             "url": url, "expect": "deny" if code else (
                                 "report" if case.policy == "learner" else "allow"),
                             "body": text}
    if code:
        entry["error"] = code
    cases, errors = parse_cases("tests/parity.yaml", yaml.safe_dump({"cases": [entry]}))
    assert errors == []
    result = run_case(policy_set, cases[0], "policies/")
    assert result.diff == (), (result.diff, result.reason)


def _audit_line(policy_set: PolicySet, method: str, url: str, body: bytes,
                policy: str = "agent") -> tuple[dict[str, Any], set[str]]:
    """The fields of the request's audit line that replay reads, as the proxy's exchange
    writes them (the path without its query; ``models`` where the rule has an allowlist,
    from ``named_models``; ``mcp``, the calls its MCP step read), and the refusals the
    line cannot show: a model or MCP refusal of a body read no model or call from, and
    the metering step's where the line shows nothing it called (replay runs it on a
    body rebuilt from the models or calls shown)."""
    request = request_for(method, url)
    assert request.path is not None
    line: dict[str, Any] = {
        "sandbox": "sandbox-1", "policy": policy, "method": request.method,
        "scheme": request.scheme, "host": request.host, "port": request.port,
        "path": request.path.partition("?")[0]}
    rule = route(policy_set.credentials, policy_set.policies[policy], request).decision.rule
    blind = set(REPLAY_BLIND)
    if rule is not None and rule.models is not None:
        line["models"] = list(named_models(method, request.path, body or None))
        if not line["models"]:
            blind |= {"model_not_allowed"}
    if not line.get("models"):
        blind |= {"minted_secret_refused"}
    if rule is not None and rule.mcp is not None:
        stage = mcp_stage(rule.mcp, "enforce", method, body, frozenset(), rule.source)
        line["mcp"] = [c.record() for c in stage.calls if c.method] or [dict(NO_CALLS[0])]
        if line["mcp"] == [dict(NO_CALLS[0])] and mcp.method_refusal(method) is None:
            blind |= {"mcp_denied"}
    return line, blind


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_replay_gives_the_proxys_verdict(policy_set: PolicySet, case: Case) -> None:
    """Replayed from no policy to the parity policy: a request the proxy allows is
    newly allowed; one it refuses (by what an audit line shows) stays denied."""
    method, url, body = _request(case)
    line, blind = _audit_line(policy_set, method, url, body, case.policy)
    empty = load_policy_texts({"policies/other.yaml": "version: v1\nname: other\negress: []\n"})
    report = replay([json.dumps(line)], empty, policy_set)
    denied = _expected(case, PIPELINE - blind) is not None
    assert report.count("newly_allowed") == (0 if denied else 1), report.to_dict()


# -- the stages themselves ------------------------------------------------------------


def test_route_refuses_an_undefined_credential_before_anything_else() -> None:
    policies = load_policy_texts({"p/a.yaml": "version: v1\nname: a\negress:\n"
                                              "  - {host: x.test, credential: c}\n"
                                              "credentials:\n  c: {preset: openai, secret: s,"
                                              " hosts: [x.test]}\n"})
    policy = policies.policies["a"]
    routed = route({}, policy, Request("GET", "https", "x.test", 443, "/"))
    assert routed.refusal is not None and routed.refusal.code == "policy_denied"
    assert "'c' is not defined" in routed.refusal.reason
    good = route(policies.credentials, policy, Request("GET", "https", "x.test", 443, "/"))
    assert good.refusal is None and good.credential is not None


def test_unseen_body_stops_before_the_metering_step(policy_set: PolicySet) -> None:
    policy = policy_set.policies["agent"]
    request = request_for("POST", "https://api.openai.com/v1/chat/completions")
    unseen = evaluate(policy_set, policy, request)
    assert (unseen.result, unseen.metered) == ("allow", False)
    seen = evaluate(policy_set, policy, request, body=b'{"model": "gpt-4o"}',
                    metering=static_metering())
    assert (seen.result, seen.error, seen.metered) == ("deny", "model_not_allowed", True)
    plain = evaluate(policy_set, policy, request_for("GET", "https://other.test/ok/a"),
                     body=UNSEEN)
    assert (plain.result, plain.metered) == ("allow", True)  # nothing to meter


@pytest.mark.parametrize(("host", "result", "port"), [
    ("allowed.test", "allow", 443), ("other.test", "allow", 443),
    ("evil.test", "deny", 443), ("169.254.169.254", "allow", 443)])
def test_name_allowed_is_the_tunnel_decision(policy_set: PolicySet, host: str, result: str,
                                             port: int) -> None:
    decision, chosen = name_allowed(policy_set.policies["agent"], host)
    assert (decision.result, chosen) == (result, port)
    tunnel = route({}, policy_set.policies["agent"], Request(None, "https", host, port, None))
    assert tunnel.decision.result == decision.result


@pytest.mark.parametrize(("url", "message"), [
    ("ftp://a.test/", "unsupported URL scheme 'ftp'"),
    ("https://a.test:99999/", "invalid URL"),
    ("https:///x", "invalid URL"),
    ("https://user@a.test/", "user information"),
])
def test_request_for_reads_urls_like_the_proxy(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        request_for("GET", url)


def test_request_for_drops_a_fragment_and_keeps_the_query() -> None:
    assert request_for("get", "API.Test./a?b=1#frag") == Request("GET", "https", "api.test",
                                                                  443, "/a?b=1")
    assert request_for("CONNECT", "tcp://db.test:5432") == Request(None, "tcp", "db.test",
                                                                    5432, None)


def test_deciding_without_traffic_counts_nothing_in_the_gateways_metrics(
        policy_set: PolicySet) -> None:
    """An explain (POST /v1/explain runs in the gateway) is not a refused request: the
    static metering step leaves sandbox_gateway_*_refusals_total alone."""
    name, labels = "sandbox_gateway_model_refusals_total", {"policy": "agent",
                                                           "credential": "openai"}
    before = REGISTRY.get_sample_value(name, labels) or 0.0
    verdict = evaluate(policy_set, policy_set.policies["agent"],
                       request_for("POST", "https://api.openai.com/v1/chat/completions"),
                       body=b'{"model": "gpt-4o"}', metering=static_metering())
    assert verdict.error == "model_not_allowed"
    assert (REGISTRY.get_sample_value(name, labels) or 0.0) == before


def test_a_static_metering_step_records_nothing() -> None:
    """`policy test` and replay decide many requests with one metering step: a call
    that fits a token budget when nothing is used fits it every time (a reservation
    counted would refuse the second)."""
    policies = load_policy_texts({"p/b.yaml": """
version: v1
name: b
egress:
  - {host: budget.test, credential: budgeted}
budgets:
  - {name: day, per: sandbox, window: 24h, tokens: 6000, credentials: [budgeted]}
credentials:
  budgeted: {hosts: [budget.test], secret: k, inject: {bearer: true}}
"""})
    metering = static_metering()
    request = request_for("POST", "https://budget.test/v1/chat/completions")
    for _ in range(3):
        verdict = evaluate(policies, policies.policies["b"], request,
                           body=b'{"model": "m", "messages": [], "max_tokens": 4000}',
                           metering=metering, now=time.time())
        assert (verdict.result, verdict.error) == ("allow", None), verdict.reason
