"""A common audit line's span and log record encoded from its cached shape
(observability/otel_shape.py), differentially: every line below goes through the exporter
process's path (`OtelExport.emit_json`: the line's text read into `otel_shape.Line`, by
its shape when it has one) and through the general path (`OtelExport.general`: the
line's dict, each attribute gathered and encoded, as before shapes), each to its own real
OTLP receiver; what arrives, decoded by opentelemetry-proto, is the same message (the
random ids aside, which are compared by what they point to). Lines of every kind:
allowed, refused (reason, error, status), a workload, a sandbox's traceparent sampled or
not, an unsampled line, MCP tool spans, GenAI usage, content opted into, a line whose
fields are not as the sink writes them, a line missing fields."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.otlp_receiver import OtlpReceiver

from gateway.observability import otel_export, otel_shape
from gateway.observability.otel import OtelExport

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
USAGE = {"model": "gpt-4o-2024-08-06", "input_tokens": 11, "output_tokens": 7,
         "cached_input_tokens": None, "cost_usd": 0.001, "first_chunk_ms": 250.5}
BASE: dict[str, Any] = {
    "sandbox": "sb", "policy": "agent", "jti": "164ab491f2e4435ba6ec0857e5bd544a",
    "client": "127.0.0.1:58142", "listener": "proxy", "method": "GET", "scheme": "https",
    "host": "api.github.com", "port": 443, "path": "/repos", "decision": "allow",
    "reason": "allowed by rule policies/agent.yaml:6 (host: api.github.com)",
    "rule": "policies/agent.yaml:6", "status": 200, "error": None, "bytes_in": 1000,
    "bytes_out": 0, "duration_ms": 1.873, "path_taken": "intercept", "engine": "h1",
    "credential": "github", "policy_rev": "sha256:14b5744a5785", "usage": None,
    "workload": None, "mcp": None, "models": None, "trace": None, "dlp": None,
    "time": "2026-11-29T09:15:31.339Z", "worker": 0}
CALLS = [{"method": "tools/call", "name": "search", "decision": "allow"},
         {"method": "tools/call", "name": "delete", "decision": "deny"},
         {"method": "tools/list", "decision": "allow"}]
MCP_CONTENT = {"input": '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":'
                        '{"name":"search","arguments":{"q":"cats"}}}',
               "output": '{"jsonrpc":"2.0","id":1,"result":{"content":[]}}'}
# (the line's changes, traced, provider, content)
LINES: list[tuple[dict[str, Any], bool, str | None, dict[str, str] | None]] = [
    ({}, True, None, None),
    ({"path": "/repos/2", "status": 404}, True, None, None),
    ({"method": "CONNECT", "host": "blocked.test", "path": None, "decision": "deny",
      "reason": "host blocked.test is not allowed by policy agent", "rule": None,
      "error": "host_not_allowed", "status": 403, "credential": None}, True, None, None),
    ({"decision": "ask", "error": "approval_pending", "reason": "waits for a person"},
     True, None, None),
    ({"workload": {"namespace": "ns", "pod": "p-1", "service_account": "agent"}},
     True, None, None),
    ({"trace": f"00-{TRACE}-00f067aa0ba902b7-01"}, True, None, None),
    ({"trace": f"00-{TRACE}-00f067aa0ba902b8-00", "host": "unsampled.test"},
     False, None, None),
    ({"host": "not-traced.test"}, False, None, None),
    ({"method": None, "host": None, "path": None, "listener": "socks"}, True, None, None),
    ({"method": "POST", "host": "api.openai.com", "path": "/v1/chat/completions",
      "credential": "openai", "usage": USAGE, "models": ["gpt-4o"],
      "trace": f"00-{TRACE}-00f067aa0ba902b9-01"}, True, "openai", None),
    ({"method": "POST", "host": "api.openai.com", "path": "/v1/chat/completions",
      "credential": "openai", "usage": USAGE, "models": ["gpt-4o"]}, True, "openai",
     {"input": '{"messages":"hi [REDACTED]"}', "output": "data: answer"}),
    ({"method": "POST", "host": "mcp.test", "path": "/mcp", "mcp": CALLS,
      "error": "mcp_tool_denied"}, True, None, MCP_CONTENT),
    ({"method": "POST", "host": "plain.test", "path": "/upload"}, True, None,
     {"input": "a body [REDACTED]"}),
    ({"policy": 5, "status": "200"}, True, None, None),  # (not as the sink writes them)
    ({"status": True, "duration_ms": 2}, True, None, None),
    ({"status": None, "path": None, "duration_ms": None}, True, None, None),
    ({"workload": {"replicas": 3}}, True, None, None),
    ({"path": "/é ✓", "sandbox": "sandbox-ü"}, True, None, None),
]
ONLY = {"host": "bare.test", "decision": "allow", "time": "2026-11-29T09:15:31.339Z"}


@pytest.fixture
def receivers() -> Iterator[tuple[OtlpReceiver, OtlpReceiver]]:
    with OtlpReceiver() as new, OtlpReceiver() as old:
        yield new, old


def _export(receiver: OtlpReceiver, logs: bool) -> OtelExport:
    return OtelExport(endpoint=receiver.grpc_endpoint, logs=logs, metrics_on=False,
                      worker=1)


def _lines() -> list[tuple[dict[str, Any], bool, str | None, dict[str, str] | None]]:
    return [({**BASE, **over}, *rest) for over, *rest in LINES] + [  # type: ignore[misc]
        (ONLY, True, None, None)]


def _normalised(receiver: OtlpReceiver, kind: str,
                seen: dict[bytes, bytes] | None = None) -> list[Any]:
    """The export requests received, their random ids replaced by their order of first
    appearance (a sandbox's own ids kept), so that what each points to is compared
    (`seen`: shared by the traces and the logs, so that a log record's ids must be its
    span's)."""
    seen = {} if seen is None else seen

    def same(value: bytes) -> bytes:
        if not value or value.hex() in (TRACE, "00f067aa0ba902b7", "00f067aa0ba902b8",
                                        "00f067aa0ba902b9"):
            return value
        return seen.setdefault(value, b"id-%d" % len(seen))

    out = []
    for request in receiver.received[kind]:
        for group in (request.resource_spans if kind == "traces" else
                      request.resource_logs):
            for scope in (group.scope_spans if kind == "traces" else group.scope_logs):
                for item in (scope.spans if kind == "traces" else scope.log_records):
                    assert len(item.trace_id) in (0, 16) and len(item.span_id) in (0, 8)
                    item.trace_id = same(item.trace_id)
                    item.span_id = same(item.span_id)
                    if kind == "traces":
                        item.parent_span_id = same(item.parent_span_id)
                    out.append(item)
    return out


@pytest.mark.parametrize("logs", [False, True])
def test_shaped_lines_arrive_as_the_general_path_sends_them(
        receivers: tuple[OtlpReceiver, OtlpReceiver], logs: bool) -> None:
    new_receiver, old_receiver = receivers
    new, old = _export(new_receiver, logs), _export(old_receiver, logs)
    for n, (line, traced, provider, content) in enumerate(_lines()):
        end = 1_764_400_000_000_000_000 + n
        raw = json.dumps(line, separators=(",", ":")).encode()
        new.emit_json(raw, end, traced, provider, content)
        old.general(json.loads(raw), end, traced, provider, content, raw)
    new.close()
    old.close()
    for kind in ("traces", "logs") if logs else ("traces",):
        got, want = _normalised(new_receiver, kind), _normalised(old_receiver, kind)
        assert len(got) == len(want) > len(LINES) - 3
        for mine, theirs in zip(got, want, strict=True):
            assert mine == theirs
    resources = {r.resource_spans[0].resource.SerializeToString()
                 for r in (*new_receiver.received["traces"], *old_receiver.received["traces"])}
    assert len(resources) == 1
    assert not logs or new_receiver.received["logs"]


def test_emit_of_a_dict_takes_the_same_paths(
        receivers: tuple[OtlpReceiver, OtlpReceiver]) -> None:
    """`emit` (a line as a dict, without its text) sends what `emit_json` sends."""
    new_receiver, old_receiver = receivers
    by_dict, by_text = _export(new_receiver, True), _export(old_receiver, True)
    for n, (line, traced, provider, content) in enumerate(_lines()):
        end = 1_764_400_000_000_000_000 + n
        by_dict.emit(line, end, traced, provider, content)
        by_text.emit_json(json.dumps(line, separators=(",", ":"), default=str).encode(),
                          end, traced, provider, content)
    by_dict.close()
    by_text.close()
    for kind in ("traces", "logs"):
        assert _normalised(new_receiver, kind) == _normalised(old_receiver, kind)


def test_a_shape_is_made_once_and_only_of_its_values() -> None:
    shapes = otel_shape.Shapes()
    first = shapes.of(otel_shape.decode(json.dumps(BASE).encode()))
    again = shapes.of(otel_shape.decode(json.dumps({**BASE, "path": "/x",
                                                    "status": 500}).encode()))
    other = shapes.of(otel_shape.decode(json.dumps({**BASE, "host": "b.test"}).encode()))
    allowed_reason = shapes.of(otel_shape.decode(json.dumps(
        {**BASE, "reason": "another rule's words"}).encode()))
    assert again is first and allowed_reason is first  # (an allow's reason is not sent)
    assert other is not first and b"b.test" in other.name


def test_a_line_not_as_the_sink_writes_it_is_not_shaped() -> None:
    for odd in ({"policy": 5}, {"workload": {"replicas": 3}}, {"decision": True},
                {"status": "200"}, {"status": True}, {"duration_ms": "1.5"}, {"path": 3}):
        with pytest.raises(ValueError):
            otel_shape.decode(json.dumps({**BASE, **odd}).encode())


def test_ids_are_new_and_never_zero_and_a_sandbox_trace_is_kept() -> None:
    drawn = {otel_shape.ids(None) for _ in range(200)}
    assert len(drawn) == 200
    assert all(len(t) == 16 and len(s) == 8 and any(t) and any(s) for t, s in drawn)
    parent = (bytes.fromhex(TRACE), bytes.fromhex("00f067aa0ba902b7"), 1)
    trace, own = otel_shape.ids(parent)
    assert trace == parent[0] and own != parent[1] and len(own) == 8


def _datagram(lines: list[tuple[dict[str, Any], bool, str | None, dict[str, str] | None]],
              first_end: int) -> bytes:
    """`lines` framed as the worker's tap frames them (otel_feed's frame format)."""
    return b"".join(b"\x1f".join((b"T" if traced else b"-", b"%d" % (first_end + n),
                                  (provider or "").encode(),
                                  json.dumps(content).encode() if content else b"",
                                  json.dumps(line, separators=(",", ":")).encode())) + b"\n"
                    for n, (line, traced, provider, content) in enumerate(lines))


@pytest.mark.parametrize("logs", [False, True])
def test_a_datagram_read_at_once_arrives_as_the_general_path_sends_it(
        receivers: tuple[OtlpReceiver, OtlpReceiver], logs: bool) -> None:
    """The exporter's loop step (`otel_export.take` with `OtelExport.emit_many`: a
    datagram's lines decoded in one array, the common ones emitted from their shapes in
    the loop) against the general path, line by line, in order. The first datagram holds
    every line typed as the sink writes it: only the uncommon ones (usage, MCP, content,
    a provider, a sandbox's trace) go alone; the second holds a line that is not (the
    whole datagram goes frame by frame); the third a frame that is not five fields."""
    new_receiver, old_receiver = receivers
    new, old = _export(new_receiver, logs), _export(old_receiver, logs)
    every = _lines()
    typed = [entry for entry in every if entry[0].get("policy") != 5 and
             entry[0].get("status") is not True and
             entry[0].get("workload") != {"replicas": 3}]
    odd = [entry for entry in every if entry not in typed]
    alone: list[bytes] = []

    def emit(raw: bytes, *rest: Any) -> None:
        alone.append(raw)
        new.emit_json(raw, *rest)

    bad = [0]
    end = 1_764_400_000_000_000_000
    for group in (typed, odd + typed[:3]):
        otel_export.take(_datagram(group, end), emit, bad, new.emit_many)
        end += len(group)
    otel_export.take(_datagram(typed[:2], end) + b"not a frame\n", emit, bad, new.emit_many)
    assert bad == [1]
    singled = [json.loads(raw) for raw in alone]
    assert [line for line, traced, provider, content in typed
            if line.get("usage") or line.get("mcp") or line.get("trace") or provider or
            content] == singled[:len(singled) - len(odd) - 3 - 2]
    end = 1_764_400_000_000_000_000
    for line, traced, provider, content in (*typed, *odd, *typed[:3], *typed[:2]):
        raw = json.dumps(line, separators=(",", ":")).encode()
        old.general(json.loads(raw), end, traced, provider, content, raw)
        end += 1
    new.close()
    old.close()
    mine_seen: dict[bytes, bytes] = {}
    theirs_seen: dict[bytes, bytes] = {}
    for kind in ("traces", "logs") if logs else ("traces",):
        got = _normalised(new_receiver, kind, mine_seen)
        want = _normalised(old_receiver, kind, theirs_seen)
        assert len(got) == len(want) > len(every)
        for mine, theirs in zip(got, want, strict=True):
            assert mine == theirs


def test_new_ids_are_never_zero_and_not_repeated_across_draws() -> None:
    drawn = [otel_shape.new_ids() for _ in range(3 * otel_shape._IDS_DRAWN + 7)]
    assert len(set(drawn)) == len(drawn)
    assert len({own for _, own in drawn}) == len(drawn)
    assert all(len(t) == 16 and len(s) == 8 and any(t) and any(s) for t, s in drawn)


def test_a_shape_remembered_last_is_the_one_of_the_same_values() -> None:
    """The last key's shortcut (no hashing) returns a line's shape only for the same
    values: a line between two others of one shape, of another shape, gets its own."""
    shapes = otel_shape.Shapes()
    base = otel_shape.decode(json.dumps(BASE).encode())
    other = otel_shape.decode(json.dumps({**BASE, "rule": "policies/agent.yaml:7"}).encode())
    first, second, third = shapes.of(base), shapes.of(other), shapes.of(base)
    assert first is third and second is not first
    assert b"agent.yaml:7" in second.head and b"agent.yaml:7" not in first.head
