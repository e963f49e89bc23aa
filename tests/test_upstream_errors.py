"""Error answers in the gateway's shape (gateway.upstream_errors), never quoting what an
upstream sent: parse errors carry its bytes, which may hold an injected key."""

from __future__ import annotations

import json

import pytest

from gateway.upstream_errors import error_response


def _body(wire: bytes) -> dict[str, str]:
    return json.loads(wire.split(b"\r\n\r\n", 1)[1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("message", [
    "unexpected server response: b'HTTP/1.1 200 sk-live-key\\r\\n'",
    'Cannot parse HTTP response: Bad HTTP response line: b"it\'s sk-live-key"',
    "the upstream sent an invalid response: Bad HTTP response line: b'sk-live-key",
])
def test_upstream_bytes_are_not_quoted(message: str) -> None:
    wire = error_response(502, message)
    assert wire.startswith(b"HTTP/1.1 502 ") and b"sk-live-key" not in wire
    body = _body(wire)
    assert body["error"] == "upstream_failed" and "<bytes>" in body["reason"]


def test_plain_reasons_stay_readable() -> None:
    body = _body(error_response(502, "example.test:443: Connection refused"))
    assert "Connection refused" in body["reason"]
    refused = error_response(502, "refused: 10.0.0.1 is a private range")
    assert refused.startswith(b"HTTP/1.1 403 ")
    assert _body(refused)["error"] == "forbidden_destination"
    assert _body(error_response(400, "bad"))["error"] == "bad_request"
