"""The audit line's `trace` (issue 45): the request's W3C traceparent, kept only when it
is one (never arbitrary header text in the audit trail or in exported spans)."""

from __future__ import annotations

import pytest

from gateway.core.audit import FIELDS, child_traceparent, record, traceparent

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
CASES = [
    (TP, TP),
    (f"  {TP} ", TP),
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", TP[:-2] + "00"),
    # a later version may carry more fields: the first four are read
    ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
     "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", None),  # v00: 4 only
    ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),  # invalid version
    ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),  # zero trace id
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", None),  # zero parent id
    ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", None),  # upper case
    ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", None),  # short
    ("Bearer sk-secret", None),
    ("", None),
    (None, None),
    (TP + "-" + "x" * 300, None),  # too long to be read
]


@pytest.mark.parametrize(("header", "expected"), CASES)
def test_traceparent(header: str | None, expected: str | None) -> None:
    assert traceparent(header) == expected


def test_the_line_carries_it() -> None:
    line = record(identity=None, client=None, listener="proxy", method="GET", scheme="https",
                  host="a.test", port=443, path="/", decision="allow", reason="r", rule=None,
                  status=200, error=None, bytes_in=0, bytes_out=0, started=1.0,
                  path_taken="intercept", engine="h1", now=2.0, trace=TP)
    assert tuple(line) == FIELDS and "trace" in FIELDS and line["trace"] == TP


@pytest.mark.parametrize(("header", "expected"), [(TP, TP), ("not-a-trace", None)])
def test_the_trail_checks_what_the_request_sent(header: str, expected: str | None) -> None:
    from typing import Any

    from gateway.core.client import Client
    from gateway.core.policy import PolicySet
    from gateway.core.refusal import Refusal
    from gateway.core.trail import Trail

    lines: list[dict[str, Any]] = []
    trail = Trail(lines.append, lambda: PolicySet({}, {}, revision="r1"), clock=lambda: 5.0)
    client = Client(("127.0.0.1", 5000))
    trail.audit(client, decision="allow", reason="ok", rule=None, method="GET", trace=header)
    trail.refuse(client, Refusal("policy_denied", "no"), method="GET", host="a.test",
                 trace=header)
    assert [line["trace"] for line in lines] == [expected, expected]


def test_content_goes_to_the_content_sink_and_never_into_the_line() -> None:
    """A line with content (`telemetry: {content: true}`) goes to `content_sink` with
    it, beside the line; without a content sink (no exporter) the content is dropped and
    the line goes as any other; the line never carries it."""
    from typing import Any

    from gateway.core.client import Client
    from gateway.core.policy import PolicySet
    from gateway.core.refusal import Refusal
    from gateway.core.trail import Trail

    lines: list[dict[str, Any]] = []
    with_content: list[tuple[dict[str, Any], dict[str, str]]] = []
    trail = Trail(lines.append, lambda: PolicySet({}, {}, revision="r1"), clock=lambda: 5.0)
    client = Client(("127.0.0.1", 5000))
    content = {"input": "the prompt"}
    trail.audit(client, decision="allow", reason="ok", rule=None, method="POST",
                content=content)  # (no content sink: as any line)
    trail.content_sink = lambda line, found: with_content.append((line, found))
    trail.audit(client, decision="allow", reason="ok", rule=None, method="POST",
                content=content)
    trail.refuse(client, Refusal("policy_denied", "no"), method="POST", content=content)
    trail.audit(client, decision="allow", reason="ok", rule=None, method="GET")
    assert [line["method"] for line in lines] == ["POST", "GET"]
    assert [(line["decision"], found) for line, found in with_content] == [
        ("allow", content), ("deny", content)]
    assert "the prompt" not in repr(lines + [line for line, _ in with_content])


@pytest.mark.parametrize(("trace", "expected"), [
    (None, "00-0af7651916cd43dd8448eb211c80319c-a1b2c3d4e5f60718-01"),  # a new trace
    (TP, "00-4bf92f3577b34da6a3ce929d0e0e4736-a1b2c3d4e5f60718-01"),  # the sandbox's
    (TP[:-2] + "00", "00-4bf92f3577b34da6a3ce929d0e0e4736-a1b2c3d4e5f60718-01"),
    ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # a later version: 00
     "00-4bf92f3577b34da6a3ce929d0e0e4736-a1b2c3d4e5f60718-01"),
])
def test_the_traceparent_sent_upstream_names_the_gateway_s_span(trace: str | None,
                                                                expected: str) -> None:
    """`telemetry.propagate`: the gateway's span is the parent the upstream sees, in the
    sandbox's trace when it sent one (checked first: `traceparent`), sampled."""
    sent = child_traceparent(trace, "0af7651916cd43dd8448eb211c80319c", "a1b2c3d4e5f60718")
    assert sent == expected and traceparent(sent) == sent


def test_the_line_carries_what_was_sent() -> None:
    line = record(identity=None, client=None, listener="proxy", method="GET", scheme="https",
                  host="a.test", port=443, path="/", decision="allow", reason="r", rule=None,
                  status=200, error=None, bytes_in=0, bytes_out=0, started=1.0,
                  path_taken="intercept", engine="h1", now=2.0, trace=TP, trace_sent="x")
    assert tuple(line) == FIELDS and (line["trace"], line["trace_sent"]) == (TP, "x")
