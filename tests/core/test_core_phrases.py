"""error_phrase: a parser's words, never the bytes it quotes (they may hold an echoed key)."""

from __future__ import annotations

import pytest

from gateway.core.phrases import WITHHELD, error_phrase

KEY = "sk-echoed-key-0123456789"


@pytest.mark.parametrize(("detail", "phrase"), [
    (f"illegal status line: bytearray(b'HTTP/1.1 OK {KEY}')", "illegal status line"),
    (f"Cannot parse HTTP response: Bad HTTP response line: b'{KEY}'",
     "Cannot parse HTTP response: Bad HTTP response line"),
    (f"Invalid transfer encoding header: 'Bearer {KEY}'", "Invalid transfer encoding header"),
    (f'Unexpected data from server: b"{KEY}"', "Unexpected data from server"),
    (f"unexpected server response: bytes(b'{KEY}')", "unexpected server response"),
    ("[Errno 111] Connect call failed ('127.0.0.1', 443)", "[Errno 111] Connect call failed"),
    (f"'{KEY}'", "error"),
])
def test_quoted_bytes_are_withheld(detail: str, phrase: str) -> None:
    assert error_phrase(detail) == f"{phrase} {WITHHELD}"


@pytest.mark.parametrize(("detail", "phrase"), [
    ("no response", "no response"),
    ("certificate verify failed: self-signed certificate", "certificate verify failed: "
     "self-signed certificate"),
    ("", "error"),
    ("line one\nline two\r", "line one?line two?"),  # no forged log lines
    ("x" * 500, "x" * 197 + "..."),
])
def test_unquoted_words_are_kept_printable_and_bounded(detail: str, phrase: str) -> None:
    assert error_phrase(detail) == phrase
