"""`clean.CleanBodies`: whether a whole body holds nothing detection could find, decided by
the gate's flags and its Content-Type's reading. Held, with the C pass and without, to
a plain reading of what each receiver undoes, and never True where the scan finds."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.core.dlp import DEFAULT, Scanner, clean, fastscan
from gateway.core.dlp.decoding import Unreadable, body_kind, json_codec, text_codec
from gateway.core.dlp.prefilter import JSON_ESCAPE
from gateway.services.dlp.library import build

JSON, FORM, TEXT = "application/json", "application/x-www-form-urlencoded", "text/plain"
CHAT = json.dumps({"messages": [{"role": "user", "content": "def f(x):\n    return x\n"}]})

ENGINES = [pytest.param(True, id="native",
                        marks=pytest.mark.skipif(not fastscan.NATIVE, reason="no C pass")),
           pytest.param(False, id="python")]


@pytest.fixture(params=ENGINES)
def scanner(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Scanner]:
    monkeypatch.setattr(fastscan, "NATIVE", request.param)
    found = Scanner(build(DEFAULT), b"test-salt")
    assert found.prefilter.gate.native is request.param
    yield found


@pytest.mark.parametrize(("ctype", "body", "expected"), [
    (JSON, CHAT, True),  # (an ordinary request: `\n` is not an escape that hides)
    (JSON, "", True),
    (JSON, '{"u": "https:\\/\\/x"}', False),  # (a JSON reader undoes \/)
    (JSON, '{"u": "\\u0041KIA"}', False),
    (TEXT, '{"u": "a\\/b"}', False),  # (JSON by its first character)
    (None, ' \n["a\\/b"]', False),
    (TEXT, 'a \\/ b', False),  # (text: read as it is, and with JSON's escapes undone)
    (TEXT, 'a \\n b', True),  # (`\\n` hides nothing: not read again)
    (FORM, "a=1&b=two", True),
    (FORM, "a=1%20", False),
    (FORM, "a=b+c", False),
    (f"{FORM}; charset=utf-8", "a=1", True),
    (f"{TEXT}; charset=utf-16", "abc", False),  # (ASCII is not its own bytes there)
    (f"{TEXT}; charset=no-such-codec", "abc", False),
    ("multipart/form-data; boundary=x", "--x\r\n\r\nhello\r\n--x--\r\n", False),
    (JSON, CHAT.encode("utf-16"), False),
    (JSON, CHAT.encode("utf-32-be"), False),
    (TEXT, b"\xff\xfeh\x00i\x00", False),  # (a UTF-16 byte-order mark)
    (JSON, b"\x00\x00\x00{", False),  # (UTF-32 by its NULs)
    (JSON, '{"k": "AKIAIOSFODNN7EXAMPLE"}', False),  # (an anchor)
    (TEXT, "x " + "Ab1" * 7, False),  # (a base64 run)
])
def test_a_body_is_clean_only_where_its_reader_reads_nothing(
        scanner: Scanner, ctype: str | None, body: str | bytes, expected: bool) -> None:
    raw = body.encode() if isinstance(body, str) else body
    assert scanner.body_clean(raw, ctype) is expected


def _reference(scanner: Scanner, body: bytes, ctype: str | None) -> bool:
    """A body is clean where it reads as its bytes and the prefilter finds no candidate
    in the reading its receiver makes (the scanner's check before `clean`)."""
    if not body:
        return True
    lowered = (ctype or "").lower()
    if "multipart/" in lowered:
        return False
    kind = body_kind(body, lowered)
    try:
        codec = json_codec(body) if kind == "json" else text_codec(body, lowered)
    except Unreadable:
        return False
    # (read with JSON's escapes undone too, whatever its type: a JSON document sent as a
    # form, a text a lenient JSON reader reads)
    return codec == "latin-1" and not any(scanner.prefilter.candidate(body, k)
                                          for k in (kind, "json"))


_PIECES = [b"a", b"Zq", b" ", b"\n", b"{", b"[", b'"', b"\\", b"\\/", b"\\u0041", b"\\n",
           b"%", b"%41", b"+", b"=", b"&", b"\x00", b"\xfe", b"\xff", b"\xef\xbb\xbf",
           b"ghp_", b"AKIA", b"sk-", b"://", b"Ab1Cd2Ef3Gh4Ij5Kl6Mn7", b"\xe9"]
_TYPES = [None, JSON, TEXT, FORM, "application/vnd.api+json", f"{TEXT}; charset=latin-1",
          f"{TEXT}; charset=utf-16le", f"{FORM}; charset=UTF-8", "TEXT/PLAIN",
          "multipart/mixed; boundary=b", "application/octet-stream"]


def test_clean_never_says_more_than_the_reference_nor_than_the_scan(scanner: Scanner) -> None:
    """Over random bodies: True only where the plain reading says clean and the scan
    finds nothing; False where the reference says True only for a body whose type names
    a charset ASCII is not its own bytes in (and that starts like JSON), or that starts
    with 0xFE, 0xFF or a NUL (the C pass's UNMARKED): the scan reads those instead."""
    rng = random.Random(43)
    differ = 0
    for n in range(3000):
        body = b"".join(rng.choice(_PIECES) for _ in range(rng.randrange(0, 12)))
        ctype = rng.choice(_TYPES)
        got, want = scanner.body_clean(body, ctype), _reference(scanner, body, ctype)
        if got:
            assert want, (n, body, ctype)
            assert not scanner.scan_body(body, ctype).findings, (n, body, ctype)
        elif want:
            differ += 1
            assert body[:1] in (b"\xfe", b"\xff") or b"\x00" in body[:4] or \
                "utf-16" in (ctype or ""), (n, body, ctype)
    assert differ < 300  # (the rest agree)


@pytest.mark.skipif(not fastscan.NATIVE, reason="no C pass")
def test_the_leak_guards_pass_is_taken_not_made_again() -> None:
    """The leak guard asks the gate first and keeps its answer; `clean` takes it (the C
    pass runs once a body), and a body `clean` does not read drops it."""
    scanner = Scanner(build(DEFAULT), b"test-salt")
    gate = scanner.prefilter.gate
    body = CHAT.encode()
    gate.flags(body, keep=True, escapes=True)
    native: Any = gate._native
    calls: list[tuple[bytes, ...]] = []

    class Counting:  # (the C calls)
        def flags(self, *args: bytes) -> int:
            calls.append(args)
            return int(native.flags(*args))

    gate._native = Counting()
    try:
        assert scanner.body_clean(body, JSON) and calls == []
        gate.flags(body, keep=True)
        assert not scanner.body_clean(body, "multipart/form-data; boundary=b")
        assert gate._kept is None
    finally:
        gate._native = native


def test_a_types_reading_is_remembered_bounded() -> None:
    clean._TYPES.clear()
    for n in range(600):
        assert clean.reading(f"application/x-{n}+json") == "json"
        assert len(clean._TYPES) <= clean._TYPES_KEPT
    assert [clean.reading(t) for t in (TEXT, FORM, "Multipart/Form-Data", None,
                                       f"{TEXT}; charset=utf-32")] == \
        ["text", "form", "other", "text", "other"]
    assert JSON_ESCAPE.search(b"\\/")
