"""The content a policy exports (pipeline/exchange_content.py), with the real DLP
detectors: the request body and the answer as relayed, every credential found replaced
in each, text where one cannot be cut out withheld, parts cut only after redaction, and
an answer relayed encoded never exported; a body streamed through and WebSocket
messages kept the same way."""

from __future__ import annotations

import base64
import json

import pytest
from helpers.dlp_corpus import fake

from gateway.core.dlp import DEFAULT, Scanner
from gateway.pipeline.exchange_content import CAP, CUT, KEEP, WITHHELD, ContentCapture
from gateway.services.dlp.library import build

SCANNER = Scanner(build(DEFAULT), b"salt")
GH = fake("github").text
AWS = fake("aws").text


def test_nothing_captured_exports_nothing() -> None:
    assert ContentCapture(SCANNER).export() == {}


def test_the_request_and_the_answer_are_exported_as_relayed() -> None:
    capture = ContentCapture(SCANNER)
    body = json.dumps({"messages": [{"role": "user", "content": "tell me a joke"}]}).encode()
    capture.request(body)
    capture.request(b"a second body is not the request")  # (once)
    for chunk in (b'data: {"delta":"Why', b' did"}\n\n', b"", b"data: [DONE]\n\n"):
        capture.answer(chunk)
    assert capture.export() == {"input": body.decode(),
                                "output": 'data: {"delta":"Why did"}\n\ndata: [DONE]\n\n'}


@pytest.mark.parametrize("where", ["input", "output"])
@pytest.mark.parametrize("value", [GH, AWS])
def test_credentials_found_are_replaced(where: str, value: str) -> None:
    capture = ContentCapture(SCANNER)
    text = json.dumps({"content": f"use {value} please"}).encode()
    if where == "input":
        capture.request(text, "application/json")
    else:
        capture.answer(text, None, "application/json")
    exported = capture.export()[where]
    assert value not in exported and "[REDACTED]" in exported
    assert "please" in exported


def test_without_detectors_the_text_goes_as_captured() -> None:
    """(The runtime's log redaction still runs after: keys, minted secrets, tokens.)"""
    capture = ContentCapture(None)
    capture.request(f"x {GH}".encode())
    assert capture.export() == {"input": f"x {GH}"}


def test_a_credential_inside_base64_is_cut_out_in_its_encoding() -> None:
    capture = ContentCapture(SCANNER)
    hidden = base64.b64encode(f"token={GH}".encode()).decode()
    capture.request(f"look: {hidden}".encode(), "text/plain")
    exported = capture.export()["input"]
    assert exported.startswith("look: ") and hidden not in exported
    assert b"[REDACTED]" in base64.b64decode(exported[6:])


def test_a_credential_that_cannot_be_cut_out_withholds_the_part() -> None:
    """A JSON string that hides the token behind an escape the redaction does not
    rewrite (found by the scanner, which reads JSON as the receiver does): withheld."""
    capture = ContentCapture(SCANNER)
    escaped = f"\\u00{ord(GH[0]):02x}{GH[1:]}"
    capture.request(('{"content": "' + escaped + '"}').encode(), "application/json")
    capture.answer(b"fine", None, "text/plain")
    assert capture.export() == {"input": WITHHELD, "output": "fine"}


def test_parts_are_cut_after_redaction() -> None:
    """A credential straddling the export cut is still found whole (kept past the cut,
    redacted, then cut): no fragment of it is exported."""
    capture = ContentCapture(SCANNER)
    prefix = "a" * (CAP - 10) + " "
    capture.answer((prefix + GH + " " + "b" * KEEP).encode())
    exported = capture.export()["output"]
    assert exported.endswith(CUT) and len(exported) == CAP + len(CUT)
    assert GH[:10] not in exported[len(prefix) - 1:]


def test_an_answer_relayed_encoded_is_not_exported() -> None:
    capture = ContentCapture(SCANNER)
    capture.answer(b"\x1f\x8b\x08binary", "gzip")
    capture.answer(b"more", None)
    assert capture.export() == {
        "output": "[content not exported: the answer was relayed encoded (gzip)]"}


def test_a_streamed_body_is_kept_piece_by_piece_and_redacted_whole() -> None:
    """A body streamed through (never held whole) is kept as its pieces come, up to
    KEEP; a credential split across two pieces is still found and replaced."""
    capture = ContentCapture(SCANNER)
    text = f"upload: {GH} done".encode()
    cut = text.index(GH.encode()) + 5
    for piece in (text[:cut], text[cut:], b"x" * KEEP):
        capture.request(piece, "text/plain", whole=False)
    exported = capture.export()["input"]
    assert GH not in exported and GH[:5] not in exported[:40]
    assert exported.startswith("upload: [REDACTED] done") and exported.endswith(CUT)


def test_websocket_messages_are_input_and_output_one_a_line() -> None:
    capture = ContentCapture(SCANNER)
    capture.message(True, b'{"type":"session.update","instructions":"' + GH.encode() + b'"}')
    capture.message(False, b'{"type":"session.updated"}')
    capture.message(True, b'{"type":"response.create"}')
    capture.message(False, b"")
    exported = capture.export()
    assert exported["input"].splitlines() == [
        '{"type":"session.update","instructions":"[REDACTED]"}', '{"type":"response.create"}']
    assert exported["output"] == '{"type":"session.updated"}\n'


def test_websocket_messages_are_kept_up_to_keep() -> None:
    capture = ContentCapture(None)
    for _ in range(3):
        capture.message(False, b"a" * (KEEP // 2))
    assert len(capture.export()["output"]) == CAP + len(CUT)
