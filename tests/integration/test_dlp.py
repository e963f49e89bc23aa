"""Outbound credential detection (issue 43) through a real gateway and upstream: what the
audit line says (detector, where, a salted fingerprint, never the value), `report` and
`redact` on the way, inheritance through `extends`, `mode: report`, the salt file, and
that a policy without `dlp:` never loads the detectors, and the findings counter
(`sandbox_gateway_dlp_findings_total`: detector, action, engine; never a value). The
refusal on every engine and
encoding is in the parity table (`DLP:` rows of tests/helpers/parity_cases.py)."""

from __future__ import annotations

import base64
import gzip
import json
import ssl
import stat
import time
import urllib.request
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest
from helpers.clients import open_tunnel
from helpers.dlp_corpus import fake
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.metrics import metric
from helpers.parity import Spec, run
from helpers.upstream import Upstream

GH = fake("github").text
AWS = fake("aws").text
POLICY = """
version: v1
name: base
dlp: {action: refuse}
egress: []
---
version: v1
name: agent
extends: [base]
egress:
  - host: allowed.test
  - host: other.test
    paths: ["/report/**"]
    dlp: {action: report}
  - host: other.test
    paths: ["/redact/**"]
    dlp: {action: redact}
  - host: other.test
    paths: ["/off/**"]
    dlp: false
  - host: other.test
---
version: v1
name: trial
mode: report
dlp: {action: refuse}
egress:
  - host: other.test
"""


def _send(gw: GatewayThread, token: str, path: str, body: bytes = b"",
          headers: list[tuple[str, str]] | None = None, host: str = "other.test") -> Any:
    assert gw.gateway.proxy_address is not None
    cred = base64.b64encode(f"sandbox-1:{token}".encode()).decode()
    return run(Spec(host=host, method="POST" if body else "GET", target=path,
                    headers=headers or [], body=base64.b64encode(body).decode(),
                    proxy=gw.gateway.proxy_address, proxy_auth=f"Basic {cred}",
                    cafile=str(gw.ca_cert)))


def _line(gw: GatewayThread, before: int) -> dict[str, Any]:
    """The last request line written after the first `before` lines (waited for: the
    mitmproxy engine writes it a moment after the client has the answer)."""
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and not any(
            r["method"] != "CONNECT" for r in gw.audit.records()[before:]):
        time.sleep(0.02)
    lines = [r for r in gw.audit.records()[before:] if r["method"] != "CONNECT"]
    assert lines, gw.audit.records()[before:]
    return lines[-1]


def test_the_audit_line_names_the_finding_never_the_value(
        make_gateway: GatewayFactory, upstream: Upstream, tmp_path: Path) -> None:
    gw = make_gateway({"agent.yaml": POLICY})
    token = gw.mint("agent")
    marks = []
    for where in ("header", "body"):
        before, seen = len(gw.audit.records()), len(upstream.requests)
        if where == "header":
            result = _send(gw, token, "/x", headers=[("X-Deploy", GH)])
        else:
            result = _send(gw, token, "/x", json.dumps({"a": [{"b": GH}]}).encode(),
                           [("Content-Type", "application/json")])
        assert (result.status, result.code) == (403, "secret_detected"), result
        assert "github" in result.body and GH not in result.body
        line = _line(gw, before)
        assert (line["decision"], line["error"]) == ("deny", "secret_detected")
        (found,) = line["dlp"]
        assert found["detector"] == "github" and found["action"] == "refuse"
        assert found["where"] == ("header X-Deploy" if where == "header" else "body $.a[0].b")
        assert GH not in json.dumps(line)
        marks.append(found["fingerprint"])
        assert len(upstream.requests) == seen  # (refused: nothing reached the upstream)
    assert marks[0] == marks[1] and len(marks[0]) == 16  # the same key, the same mark
    # (inherited from `base` through extends: host-only allowed.test is intercepted too)
    before = len(gw.audit.records())
    assert _send(gw, token, "/x", headers=[("X-K", AWS)], host="allowed.test").code == \
        "secret_detected"
    assert _line(gw, before)["dlp"][0]["detector"] == "aws"
    salt = tmp_path / "certs" / "dlp-salt"
    assert stat.S_IMODE(salt.stat().st_mode) == 0o600 and len(salt.read_bytes()) == 32


def _findings(gw: GatewayThread, **labels: str) -> float:
    return metric(gw, "sandbox_gateway_dlp_findings_total", **labels)


def test_findings_are_counted_by_detector_action_and_engine(
        make_gateway: GatewayFactory) -> None:
    gw = make_gateway({"agent.yaml": POLICY})
    token = gw.mint("agent")
    counts = {a: _findings(gw, detector="github", action=a, engine="h1")
              for a in ("refuse", "report", "redact")}
    assert _send(gw, token, "/x", headers=[("X-Deploy", GH)]).code == "secret_detected"
    assert _send(gw, token, "/report/x", f"a={GH}&b={AWS}".encode(),
                 [("Content-Type", "application/x-www-form-urlencoded")]).status == 200
    assert _send(gw, token, "/redact/x", f"note {GH}".encode(),
                 [("Content-Type", "text/plain")]).status == 200
    for action in ("refuse", "report", "redact"):
        assert _findings(gw, detector="github", action=action, engine="h1") == \
            counts[action] + 1, action
    assert _findings(gw, detector="aws", action="report", engine="h1") >= 1
    with urllib.request.urlopen(gw.admin + "/metrics", timeout=5) as answer:
        exposed = answer.read().decode()
    assert "sandbox_gateway_dlp_findings_total" in exposed
    assert GH not in exposed and GH[:12] not in exposed  # (no value, no part of one)


def test_report_and_redact_forward_and_record(make_gateway: GatewayFactory,
                                             upstream: Upstream) -> None:
    gw = make_gateway({"agent.yaml": POLICY})
    token = gw.mint("agent")
    before, seen = len(gw.audit.records()), len(upstream.requests)
    result = _send(gw, token, "/report/x", f"key={GH}".encode(),
                   [("Content-Type", "application/x-www-form-urlencoded")])
    assert result.status == 200
    assert GH.encode() in upstream.requests[seen].body
    line = _line(gw, before)
    assert (line["decision"], line["error"]) == ("allow", None)
    assert [(f["detector"], f["where"], f["action"]) for f in line["dlp"]] == \
        [("github", "body form field key", "report")]

    before, seen = len(gw.audit.records()), len(upstream.requests)
    body = gzip.compress(json.dumps({"note": f"push with {GH}"}).encode())
    result = _send(gw, token, "/redact/x", body,
                   [("Content-Type", "application/json"), ("Content-Encoding", "gzip")])
    assert result.status == 200
    got = upstream.requests[seen]
    assert got.headers.get("content-encoding") == "gzip"
    assert int(got.headers["content-length"]) == len(got.body)
    assert json.loads(gzip.decompress(got.body)) == {"note": "push with [REDACTED]"}
    assert _line(gw, before)["dlp"][0]["action"] == "redact"

    before, seen = len(gw.audit.records()), len(upstream.requests)
    assert _send(gw, token, "/off/x", headers=[("X-Deploy", GH)]).status == 200
    assert _line(gw, before)["dlp"] is None


def test_mode_report_records_instead_of_refusing(make_gateway: GatewayFactory) -> None:
    gw = make_gateway({"agent.yaml": POLICY})
    token = gw.mint("trial")
    before = len(gw.audit.records())
    assert _send(gw, token, "/x", headers=[("X-Deploy", GH)]).status == 200
    line = _line(gw, before)
    assert line["error"] is None and line["dlp"][0]["action"] == "report"


def test_without_dlp_the_detectors_are_not_built(make_gateway: GatewayFactory) -> None:
    gw = make_gateway()
    assert gw.gateway.detectors is not None and not gw.gateway.detectors.built
    token = gw.mint("agent")
    assert _send(gw, token, "/", headers=[("X-Deploy", GH)]).status == 200
    assert not gw.gateway.detectors.built


def test_a_body_that_cannot_be_read_is_refused(make_gateway: GatewayFactory,
                                               upstream: Upstream) -> None:
    """Fail closed: a body in a charset the scan has no codec for is refused where dlp:
    applies, and goes on where it does not. (A gzip body that decodes past the hold
    limit was refused so on HTTP/1 until the twenty-first session: it is read as it
    decodes now, as the engines that stream it did: parity rows.)"""
    gw = make_gateway({"agent.yaml": POLICY})
    token = gw.mint("agent")
    body = b"notes for the build"
    headers = [("Content-Type", "text/plain; charset=x-klingon")]
    before, seen = len(gw.audit.records()), len(upstream.requests)
    result = _send(gw, token, "/x", body, headers)
    assert (result.status, result.code) == (403, "secret_detected"), result
    assert "cannot be checked for credentials" in result.body
    assert _line(gw, before)["error"] == "secret_detected"
    assert len(upstream.requests) == seen
    assert _send(gw, token, "/off/x", body, headers).status == 200
    bomb = gzip.compress(b"\0" * (2 << 20))
    coded = [("Content-Type", "application/octet-stream"), ("Content-Encoding", "gzip")]
    assert _send(gw, token, "/x", bomb, coded).status == 200


def _h2_exchange(gw: GatewayThread, token: str,
                 requests: list[tuple[str, str, list[tuple[str, str]], bytes]]
                 ) -> tuple[dict[int, tuple[str, bytes]], list[Any]]:
    """The requests sent at once on one HTTP/2 connection (all streams open before any
    answer is read); returns each stream's (status, body) and the connection's events."""
    assert gw.gateway.proxy_address is not None
    ctx = ssl.create_default_context(cafile=str(gw.ca_cert))
    ctx.set_alpn_protocols(["h2"])
    answers: dict[int, tuple[str, bytes]] = {}
    statuses: dict[int, str] = {}
    bodies: dict[int, bytes] = {}
    events: list[Any] = []
    with (open_tunnel(gw.gateway.proxy_address, "other.test:443", token) as raw,
          ctx.wrap_socket(raw, server_hostname="other.test") as tls):
        assert tls.selected_alpn_protocol() == "h2"
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        streams = []
        for method, path, headers, body in requests:
            stream = conn.get_next_available_stream_id()
            streams.append(stream)
            length = [("content-length", str(len(body)))] if body else []
            conn.send_headers(stream, [(":method", method), (":scheme", "https"),
                                       (":authority", "other.test"), (":path", path),
                                       *headers, *length], end_stream=not body)
            if body:
                conn.send_data(stream, body, end_stream=True)
        tls.sendall(conn.data_to_send())
        tls.settimeout(15)
        while len(answers) < len(streams):
            data = tls.recv(65536)
            if not data:
                break
            for event in conn.receive_data(data):
                events.append(event)
                if isinstance(event, h2.events.ResponseReceived):
                    statuses[event.stream_id] = dict(event.headers)[b":status"].decode()
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length,
                                                   event.stream_id)
                    bodies[event.stream_id] = bodies.get(event.stream_id, b"") + event.data
                elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                    answers[event.stream_id] = (statuses.get(event.stream_id, "reset"),
                                                bodies.get(event.stream_id, b""))
            tls.sendall(conn.data_to_send())
    return {streams.index(s): a for s, a in answers.items()}, events


def test_http2_refuses_the_stream_with_the_secret_and_serves_the_others(
        make_gateway: GatewayFactory, upstream: Upstream) -> None:
    """Issue 43 on HTTP/2 (an h2-only client is handed to mitmproxy): a credential in
    one stream's head or held body (Content-Length within the hold limit, as clients
    send a body they have whole) is answered 403 secret_detected on that stream; the
    streams opened beside it on the same connection are answered by the upstream. (A
    streamed body refused part-way ends the connection: docs/dlp.md, Where it runs.)"""
    gw = make_gateway({"agent.yaml": POLICY})
    token = gw.mint("agent")
    seen = len(upstream.requests)
    counted = _findings(gw, detector="github", action="refuse", engine="mitmproxy")
    json_type = [("content-type", "application/json")]
    answers, events = _h2_exchange(gw, token, [
        ("GET", "/h2/clean-1", [], b""),
        ("GET", "/h2/in-header", [("x-deploy", GH)], b""),
        ("POST", "/h2/in-body", json_type, json.dumps({"note": f"use {GH}"}).encode()),
        ("POST", "/h2/clean-2", json_type, json.dumps({"note": "nothing here"}).encode()),
    ])
    assert not any(isinstance(e, h2.events.ConnectionTerminated) for e in events), events
    assert answers[0][0] == answers[3][0] == "200", answers
    for refused in (1, 2):
        status, body = answers[refused]
        assert status == "403" and b"secret_detected" in body and GH.encode() not in body
    paths = sorted(r.path for r in upstream.requests[seen:])
    assert paths == ["/h2/clean-1", "/h2/clean-2"], paths
    assert _findings(gw, detector="github", action="refuse", engine="mitmproxy") == \
        counted + 2


def _h2_streamed(gw: GatewayThread, token: str, bodies: dict[str, bytes], chunk: int = 16384
                 ) -> tuple[dict[str, tuple[str, bytes]], list[Any]]:
    """POSTs of `bodies` (path: body) on one HTTP/2 connection, without Content-Length
    (streamed through the gateway), their chunks interleaved within the flow-control
    windows; a stream answered before its body is all sent stops sending. Returns each
    path's (status or "reset", body) and the connection's events."""
    assert gw.gateway.proxy_address is not None
    ctx = ssl.create_default_context(cafile=str(gw.ca_cert))
    ctx.set_alpn_protocols(["h2"])
    statuses: dict[int, str] = {}
    answers: dict[int, tuple[str, bytes]] = {}
    received: dict[int, bytes] = {}
    events: list[Any] = []
    with (open_tunnel(gw.gateway.proxy_address, "other.test:443", token) as raw,
          ctx.wrap_socket(raw, server_hostname="other.test") as tls):
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        left: dict[int, bytes] = {}
        paths: dict[int, str] = {}
        for path, body in bodies.items():
            stream = conn.get_next_available_stream_id()
            paths[stream] = path
            left[stream] = body
            conn.send_headers(stream, [(":method", "POST"), (":scheme", "https"),
                                       (":authority", "other.test"), (":path", path),
                                       ("content-type", "text/plain")])
        tls.sendall(conn.data_to_send())
        tls.settimeout(15)
        while len(answers) < len(paths):
            for stream in list(left):
                if stream in answers or stream in statuses:
                    del left[stream]  # answered (or reset): nothing more to send
                    continue
                room = min(conn.local_flow_control_window(stream), chunk,
                           conn.max_outbound_frame_size, len(left[stream]))
                if room > 0:
                    conn.send_data(stream, left[stream][:room])
                    left[stream] = left[stream][room:]
                if not left[stream]:
                    conn.end_stream(stream)
                    del left[stream]
            tls.sendall(conn.data_to_send())
            tls.settimeout(0.05 if left else 15)
            try:
                data = tls.recv(65536)
            except TimeoutError:
                continue
            if not data:
                break
            for event in conn.receive_data(data):
                events.append(event)
                if isinstance(event, h2.events.ResponseReceived):
                    statuses[event.stream_id] = dict(event.headers)[b":status"].decode()
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length,
                                                   event.stream_id)
                    received[event.stream_id] = received.get(event.stream_id, b"") + \
                        event.data
                elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                    answers[event.stream_id] = (statuses.get(event.stream_id, "reset"),
                                                received.get(event.stream_id, b""))
            tls.sendall(conn.data_to_send())
    return {paths[s]: a for s, a in answers.items()}, events


@pytest.mark.parametrize("carried", ["secret", "token"])
def test_http2_a_streamed_body_refused_part_way_ends_its_stream_alone(
        make_gateway: GatewayFactory, upstream: Upstream, carried: str) -> None:
    """A streamed HTTP/2 body (no Content-Length) refused part-way, by DLP (a GitHub
    token 100 KB in) or by the leak guard (the gateway token itself), is answered 403 on
    its own stream; the stream beside it on the same connection streams on and is
    answered by the upstream; no GOAWAY. (mitmproxy's stream filter could only close
    the whole connection: the client read 502 upstream_failed on every stream.)"""
    gw = make_gateway({"agent.yaml": POLICY})
    token = gw.mint("agent")
    seen = len(upstream.requests)
    prose = b"the quick brown fox jumps over the lazy dog " * 2500  # 110 KB
    value = GH if carried == "secret" else token
    refused = prose + f" deploy with {value} ".encode() + prose
    clean = prose * 2
    answers, events = _h2_streamed(gw, token, {"/h2/refused": refused, "/h2/clean": clean})
    assert not any(isinstance(e, h2.events.ConnectionTerminated) for e in events), events
    status, body = answers["/h2/refused"]
    code = "secret_detected" if carried == "secret" else "exfiltration_blocked"
    assert status == "403" and code.encode() in body, answers["/h2/refused"]
    assert value.encode() not in body
    assert answers["/h2/clean"][0] == "200", answers["/h2/clean"]
    got = [(r.path, len(r.body)) for r in upstream.requests[seen:]]
    assert got == [("/h2/clean", len(clean))], got


def test_findings_on_the_mitmproxy_engine_are_counted_with_its_label(
        make_gateway: GatewayFactory) -> None:
    """`network.intercept: mitmproxy` (mitmproxy serves every client): each finding is
    counted as the HTTP/1 engine counts it, labelled `engine="mitmproxy"`, and nothing
    under `h1`; a finding dlp.allow lets go is not counted."""
    gw = make_gateway({"agent.yaml": POLICY}, {"network": {"intercept": "mitmproxy"}})
    token = gw.mint("agent")
    labels = [("github", "refuse"), ("github", "report"), ("aws", "report"),
              ("github", "redact")]
    before = {(d, a, e): _findings(gw, detector=d, action=a, engine=e)
              for d, a in labels for e in ("mitmproxy", "h1")}
    mark = len(gw.audit.records())
    assert _send(gw, token, "/x", headers=[("X-Deploy", GH)]).code == "secret_detected"
    assert _line(gw, mark)["engine"] == "mitmproxy"
    assert _send(gw, token, "/report/x", f"a={GH}&b={AWS}".encode(),
                 [("Content-Type", "application/x-www-form-urlencoded")]).status == 200
    assert _send(gw, token, "/redact/x", f"note {GH}".encode(),
                 [("Content-Type", "text/plain")]).status == 200
    for (detector, action, engine), count in before.items():
        assert _findings(gw, detector=detector, action=action, engine=engine) == \
            count + (engine == "mitmproxy"), (detector, action, engine)


@pytest.mark.parametrize("size", [2_000, 3 << 20], ids=["held", "streamed"])
def test_a_key_in_a_utf16_text_body_is_found(make_gateway: GatewayFactory,
                                             upstream: Upstream, size: int) -> None:
    """A body read in the charset its Content-Type names: the key's bytes never appear
    as they are (UTF-16), held whole or streamed past the hold limit."""
    gw = make_gateway({"agent.yaml": POLICY})
    token = gw.mint("agent")
    text = "notes " * (size // 12) + f"deploy key {GH}\n"
    body = text.encode("utf-16")
    assert GH.encode() not in body
    before, seen = len(gw.audit.records()), len(upstream.requests)
    result = _send(gw, token, "/x", body, [("Content-Type", "text/plain; charset=utf-16")])
    assert result.stage == "closed" or (result.status, result.code) == (403, "secret_detected")
    line = _line(gw, before)
    assert line["error"] == "secret_detected" and line["dlp"][0]["detector"] == "github"
    assert not [r for r in upstream.requests[seen:] if len(r.body) == len(body)]


ANSWERS = """
version: v1
name: answers
dlp: {action: refuse, answers: report}
egress:
  - host: other.test
    paths: ["/dlp-answer/**"]
  - host: allowed.test
    paths: ["/dlp-answer/**"]
    dlp: {answers: off}
  - host: report.test
    paths: ["/dlp-answer/**"]
    dlp: {allow: [{detector: github, hosts: [report.test]}]}
"""
SHAPES = [("github", "json", "answer body at offset"), ("aws", "gzip", "answer body at offset"),
          ("github", "header", "answer header X-Config-Token"),
          ("github", "chunked", "answer body at offset"),
          ("github", "big", "answer body at offset"),
          ("github", "grpc-web", "answer body at offset"),
          ("github", "grpc-web-text", "answer body at offset"),
          ("github", "zstd", "answer body at offset")]  # (read since the twenty-first)


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
def test_answers_report_records_what_an_answer_holds_and_forwards_it(
        make_gateway: GatewayFactory, engine: str) -> None:
    """`dlp: {answers: report}` (issue 43, item 4): a credential in an answer - in a
    JSON body, a header, a gzip-coded body, split across two chunks, 3 MiB into a body,
    in a compressed gRPC-Web message (binary or text), in a WebSocket message from the
    upstream - reaches the sandbox unchanged and is on the audit line (detector,
    `answer ...`, fingerprint, action report; never the value), counted as a reported
    finding. `answers: off` on a rule, and a detector its
    `allow` lets come from the host, record nothing. A request's own check still
    refuses (the section's action is refuse)."""
    gw = make_gateway({"answers.yaml": ANSWERS}, {"network": {"intercept": engine}})
    token = gw.mint("answers")
    label = "h1" if engine == "fast" else "mitmproxy"
    counted = _findings(gw, detector="github", action="report", engine=label)
    for detector, shape, where in SHAPES:
        secret = fake(detector).text
        before = len(gw.audit.records())
        result = _send(gw, token, f"/dlp-answer/{detector}/{shape}")
        assert (result.status, result.code) == (200, None), (shape, result)
        got = result.headers.get("x-config-token", "") if shape == "header" else result.body
        if shape in ("gzip", "zstd"):  # (relayed as it came: coded)
            assert result.headers.get("content-encoding") == shape, result.headers
        elif shape.startswith("grpc"):  # (relayed as it came: a compressed message)
            assert secret not in got and result.headers.get("grpc-encoding") == "gzip"
        else:
            assert secret in got, (shape, got[:200])
        line = _line(gw, before)
        assert (line["decision"], line["error"], line["status"]) == ("allow", None, 200)
        (found,) = line["dlp"]
        assert (found["detector"], found["action"]) == (detector, "report"), found
        assert found["where"].startswith(where), (shape, found)
        assert secret not in json.dumps(line) and len(found["fingerprint"]) == 16
    assert _findings(gw, detector="github", action="report", engine=label) == counted + 7
    for host in ("allowed.test", "report.test"):  # (answers: off; github allowed there)
        before = len(gw.audit.records())
        assert _send(gw, token, "/dlp-answer/github/json", host=host).status == 200
        assert not _line(gw, before)["dlp"], host
    before = len(gw.audit.records())
    refused = _send(gw, token, "/dlp-answer/github/json", headers=[("X-Deploy", GH)])
    assert (refused.status, refused.code) == (403, "secret_detected")
    assert [f["where"] for f in _line(gw, before)["dlp"]] == ["header X-Deploy"]


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
def test_answers_report_says_what_it_could_not_read(make_gateway: GatewayFactory,
                                                     engine: str) -> None:
    """An answer the scan cannot read - in a coding it does not know (`compress`), two
    Content-Types that differ (the client may read it by either), more
    anchors than the scan reads - is forwarded as every answer is, and its audit line
    says so (`detector: unreadable`, `where: answer body`, the reason), counted: a
    hostile upstream does not keep a credential out of the report by sending it so."""
    gw = make_gateway({"answers.yaml": ANSWERS}, {"network": {"intercept": engine}})
    token = gw.mint("answers")
    label = "h1" if engine == "fast" else "mitmproxy"
    counted = _findings(gw, detector="unreadable", action="report", engine=label)
    for shape, why in (("compress", "unknown content coding"),
                       ("two-types", "more than one Content-Type"),
                       ("anchors", "more anchors")):
        before = len(gw.audit.records())
        result = _send(gw, token, f"/dlp-answer/github/{shape}")
        assert (result.status, result.code) == (200, None), (shape, result)
        line = _line(gw, before)
        assert (line["decision"], line["error"]) == ("allow", None), line
        unread = [f for f in line["dlp"] if f["detector"] == "unreadable"]
        assert [(f["where"], f["action"]) for f in unread] == [("answer body", "report")], \
            (shape, line["dlp"])
        assert why in unread[0]["reason"] and GH not in json.dumps(line), (shape, unread)
    assert _findings(gw, detector="unreadable", action="report", engine=label) == counted + 3


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
def test_answers_report_reads_websocket_messages_from_the_upstream(
        make_gateway: GatewayFactory, engine: str) -> None:
    gw = make_gateway({"answers.yaml": ANSWERS}, {"network": {"intercept": engine}})
    token = gw.mint("answers")
    assert gw.gateway.proxy_address is not None
    cred = base64.b64encode(f"sandbox-1:{token}".encode()).decode()
    before = len(gw.audit.records())
    result = run(Spec(host="other.test", target="/dlp-answer/github/ws", headers=[
        ("Upgrade", "websocket"), ("Connection", "Upgrade"), ("Sec-WebSocket-Version", "13"),
        ("Sec-WebSocket-Key", base64.b64encode(b"0123456789abcdef").decode())],
        ws=["hello"], proxy=gw.gateway.proxy_address, proxy_auth=f"Basic {cred}",
        cafile=str(gw.ca_cert)))
    assert result.stage == "ws-echo" and GH in result.body, result
    found = gw.audit.wait_for(lambda r: r.get("status") == 101 and bool(r.get("dlp")), 5.0)
    assert found, gw.audit.records()[before:]
    assert [(f["detector"], f["action"]) for f in found[-1]["dlp"]] == [("github", "report")]
    assert found[-1]["dlp"][0]["where"].startswith("answer message")
    assert GH not in json.dumps(found[-1])


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
def test_answers_report_reads_http2_answers(make_gateway: GatewayFactory, engine: str) -> None:
    gw = make_gateway({"answers.yaml": ANSWERS}, {"network": {"intercept": engine}})
    token = gw.mint("answers")
    assert gw.gateway.proxy_address is not None
    cred = base64.b64encode(f"sandbox-1:{token}".encode()).decode()
    for shape in ("json", "chunked"):
        before = len(gw.audit.records())
        result = run(Spec(host="other.test", target=f"/dlp-answer/github/{shape}", h2=True,
                          proxy=gw.gateway.proxy_address, proxy_auth=f"Basic {cred}",
                          cafile=str(gw.ca_cert)))
        assert result.status == 200 and GH in result.body, result
        (found,) = _line(gw, before)["dlp"]
        assert (found["detector"], found["action"]) == ("github", "report")
        assert found["where"].startswith("answer body")


ECHOED = "ghp_" + "Kq7RZx2mVt9LwNc4YbHs8PdJf3GaUe6TnQ1o"  # (the injected key: github's form)


def test_answers_report_never_flags_the_injected_key_echoed(
        make_gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The answer is scanned as the sandbox gets it: an upstream echoing the key the
    gateway injected has it redacted first (the leak guard's stricter binding), so the
    key, in github's form, is no finding; a github token the upstream sends of its own
    is one, on the same rule."""
    monkeypatch.setenv("SANDBOX_GATEWAY_SECRET_GH_KEY", ECHOED)
    policy = ANSWERS + """  - host: api.github.com
    credential: gh
credentials:
  gh: {secret: gh-key, hosts: [api.github.com], inject: {header: X-Api-Key}}
"""
    gw = make_gateway({"answers.yaml": policy})
    token = gw.mint("answers")
    for path, findings in (("/echo-header/X-Api-Key", []),
                           ("/dlp-answer/github/json", [("github", "report")])):
        before = len(gw.audit.records())
        result = _send(gw, token, path, headers=[("X-Api-Key", token)], host="api.github.com")
        assert result.status == 200 and ECHOED not in result.body + json.dumps(
            result.headers), result
        line = _line(gw, before)
        assert line["credential"] == "gh", line
        assert [(f["detector"], f["action"]) for f in line["dlp"] or []] == findings, line


def _chat(*contents: str) -> bytes:
    return json.dumps({"model": "m", "messages": [
        {"role": "tool", "tool_call_id": f"call_{i:024d}", "content": c}
        for i, c in enumerate(contents)]}).encode()


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
def test_a_conversation_sent_again_is_read_for_what_is_new(
        make_gateway: GatewayFactory, upstream: Upstream, engine: str) -> None:
    """A sandbox's conversation, sent again each turn, through the gateway: the long
    strings it sent before that held nothing are left out of the next reading
    (`core/dlp/history.py`), and what is new is read: a credential in a new turn, in a
    string beside the history's, or sent by another sandbox with the same history, is
    refused; a clean new turn passes. Each sandbox's history is its own."""
    gw = make_gateway({"agent.yaml": POLICY}, {"network": {"intercept": engine}})
    tokens = {s: gw.mint("agent", sandbox=s) for s in ("sandbox-1", "sandbox-2")}
    code = (Path(json.__file__).parent / "decoder.py").read_text()
    history = [code[:4000], code[4000:8000] + " call_Xy7Qz3abCDef12GhIjKlMn"]
    headers = [("Content-Type", "application/json")]
    scanner = gw.gateway.detectors.scanner() if gw.gateway.detectors else None

    def send(sandbox: str, *contents: str) -> Any:
        assert gw.gateway.proxy_address is not None
        cred = base64.b64encode(f"{sandbox}:{tokens[sandbox]}".encode()).decode()
        return run(Spec(host="other.test", method="POST", target="/chat", headers=headers,
                        body=base64.b64encode(_chat(*contents)).decode(),
                        proxy=gw.gateway.proxy_address, proxy_auth=f"Basic {cred}",
                        cafile=str(gw.ca_cert)))

    before = len(upstream.requests)
    assert send("sandbox-1", *history).status == 200
    assert scanner is not None
    held = scanner.only(("github",)).history  # (one store for every selection)
    assert held is not None and held.size()[0] >= 1  # (long strings remembered: two,
    # one where both hashed to one slot, as a fixed table may)
    assert send("sandbox-1", *history, "the next step").status == 200
    for contents in ((*history, f"deploy with {GH}"), (history[0], GH, history[1]),
                     (history[0], history[1][:-30] + GH)):
        result = send("sandbox-1", *contents)
        assert (result.status, result.code) == (403, "secret_detected"), contents[-1][-60:]
    result = send("sandbox-2", *history[:1], f"deploy with {GH}", history[1])
    assert (result.status, result.code) == (403, "secret_detected")
    assert all(GH.encode() not in r.body for r in upstream.requests[before:])
    assert len([r for r in upstream.requests[before:] if r.path == "/chat"]) == 2


def _archive(tmp: Path, tool: str, files: dict[str, bytes]) -> bytes:
    """An archive of `files` made by the real tool (`tar czf`, `tar cjf`, `tar cJf`,
    `zip -r`), as a sandbox uploading its workspace makes it."""
    import subprocess

    work = tmp / f"ws-{len(list(tmp.iterdir()))}"
    work.mkdir()
    for name, data in files.items():
        (work / name).write_bytes(data)
    out = work.with_suffix(f".{tool}")  # (zip names its output so)
    names = sorted(files)
    argv = {"tar.gz": ["tar", "czf", str(out), *names], "tar.bz2": ["tar", "cjf", str(out), *names],
            "tar.xz": ["tar", "cJf", str(out), *names], "zip": ["zip", "-qr", str(out), *names]}
    subprocess.run(argv[tool], cwd=work, check=True, timeout=60)
    return out.read_bytes()


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
def test_an_uploaded_archive_holding_a_credential_is_refused(
        make_gateway: GatewayFactory, upstream: Upstream, tmp_path: Path, engine: str) -> None:
    """curl uploading (`-T`, a PUT) an archive made by tar, bzip2, xz or zip: one whose
    `.env` holds a credential is refused (`secret_detected`, where `body zip entry .env`
    held, `body unpacked at offset N` streamed past the hold limit beside 2.5 MB of a
    file) and the upstream never has it whole; the same archive without it arrives as
    sent (issue 43: a workspace uploaded to an allowed object store)."""
    import random
    import subprocess

    gw = make_gateway({"agent.yaml": POLICY}, {"network": {"intercept": engine}})
    token = gw.mint("agent")
    rng = random.Random(3)
    big = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz \n") for _ in range(2_500_000))
    for tool, size in (("tar.gz", 0), ("zip", 0), ("tar.bz2", 0), ("tar.xz", 0),
                       ("tar.gz", 1), ("zip", 1)):
        readme = {"README": (big if size else "notes\n").encode()}
        for files, refused in ((readme, False), ({**readme, ".env": f"KEY={GH}\n".encode()},
                                                 True)):
            body = _archive(tmp_path, tool, files)
            path = tmp_path / f"upload-{tool}"
            path.write_bytes(body)
            before, seen = len(gw.audit.records()), len(upstream.requests)
            out = subprocess.run(
                ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "20",
                 "-T", str(path), "--proxy", gw.proxy_url(token), "--cacert",
                 str(gw.ca_cert), f"https://other.test/bucket/ws.{tool}"],
                capture_output=True, text=True, timeout=30)
            line = _line(gw, before)
            got = [r.body for r in upstream.requests[seen:]]
            if not refused:
                assert (out.stdout, line["error"], got) == ("200", None, [body]), (tool, out)
                continue
            assert line["error"] == "secret_detected", (tool, size, line)
            assert out.stdout in ("403", "000"), (tool, out)  # (000: cut mid-upload)
            [found] = line["dlp"]
            # (zip stores a file deflate does not shrink: the body's own bytes hold it)
            assert found["where"].startswith("body unpacked at offset" if size and tool !=
                                             "zip" else "body "), found
            assert body not in got and GH not in json.dumps(line), tool
