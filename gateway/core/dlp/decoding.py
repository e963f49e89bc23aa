"""Bodies as the receiver reads them: content codings undone (bounded), and the base64
and hex runs inside a text decoded.

`decode_content` undoes a Content-Encoding list (gzip, x-gzip, deflate, br, zstd, in any
stack) on a held body, with `core/encodings.py`'s decoders. Its output is bounded by
`limit` (the hold limit): a body that decodes to more, does not decode, or names a
coding not listed here raises `Unreadable`, and the caller refuses it (a body the
gateway cannot read is a body it cannot check). `encode_content` writes a rewritten
body back in the same codings.

`runs` finds base64 (standard or URL-safe) and hex runs long enough to hold a key (a
16-byte key is 22 base64 or 32 hex characters), and `decode_run` decodes one. A run is
decoded from its first character; one of at most 1 KiB also from its next three (a key's
base64 behind a character or three of something else is still found).
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from gateway.core import encodings
from gateway.core.dlp.fastscan import MAP, SEGMENT, key_run, key_runs

__all__ = ["MAX_SHIFTED", "MIN_BASE64", "Run", "Unreadable", "body_kind", "decode_content",
           "decode_run", "encode_content", "encode_run", "has_run", "json_codec", "padded_end",
           "runs", "runs_at", "stretches", "text_codec"]

MIN_BASE64 = SEGMENT  # (20)
MIN_HEX = 32
MAX_SHIFTED = 1024  # runs up to this long are also decoded from their 2nd to 4th character
_HEX = re.compile(r"(?:[0-9a-f]{2})+|(?:[0-9A-F]{2})+")
_HEX_INSIDE = re.compile(r"[0-9a-f]{32,}|[0-9A-F]{32,}")  # (MIN_HEX)


class Unreadable(ValueError):
    """A body the scanner cannot read (unknown coding, corrupt, over the hold limit)."""


def _codings(header: str | None) -> list[str]:
    return [c.strip().lower() for c in (header or "").split(",")
            if c.strip() and c.strip().lower() != "identity"]


def _one(coding: str, data: bytes, limit: int) -> bytes:
    try:
        decoder = encodings.decoder_for(coding, limit)
        assert decoder is not None
        return b"".join([*decoder.feed(data), *decoder.end()])
    except encodings.EncodingError as exc:
        raise Unreadable(str(exc)) from None


def decode_content(data: bytes, content_encoding: str | None, limit: int) -> bytes:
    """`data` with every coding of a Content-Encoding value undone (last applied first).
    Raises `Unreadable` (over `limit` decoded bytes, corrupt, unknown coding)."""
    codings = _codings(content_encoding)
    unknown = [c for c in codings if c not in ("gzip", "x-gzip", "deflate", "br", "zstd")]
    if unknown:
        raise Unreadable(f"unknown content coding {unknown[0][:40]!r}")
    for coding in reversed(codings):
        data = _one(coding, data, limit)
    if len(data) > limit:
        raise Unreadable(f"the body is more than {limit} bytes")
    return data


def encode_content(data: bytes, content_encoding: str | None) -> bytes:
    """`data` in the codings of a Content-Encoding value, in order (a rewritten body
    goes out in the coding its head names)."""
    for coding in _codings(content_encoding):
        try:
            data = encodings.encode(coding, data)
        except encodings.EncodingError as exc:
            raise Unreadable(str(exc)) from None
    return data


@dataclass(frozen=True, slots=True)
class Run:
    """A base64 or hex run at text[start:end]; `kind` is "base64" or "hex"."""

    start: int
    end: int
    kind: str


# Runs are found without a regular expression: the text's bytes are mapped to "a" (in the
# base64 alphabets) or " " (not), and `bytes.find` looks for 20 "a"s. Most texts have no
# such run, and most runs are one case: `fastscan.key_run` says so first, in C.
_NEEDLE = b"a" * MIN_BASE64


def _mapped(text: str) -> bytes:
    return text.encode("latin-1", "replace").translate(MAP)


def has_run(text: str) -> bool:
    """Whether `text` holds a run to decode (the cheap check: most texts have no 20
    base64 characters in a row, and the runs of those that do are mostly paths and
    identifiers, see `runs`)."""
    return key_run(text) and next(runs(text), None) is not None


def runs(text: str) -> Iterator[Run]:
    """Base64 and hex runs long enough to hold a key. A base64 run all in one case is
    not one (a path, a name); hex is one case by nature."""
    for start, end in stretches(text):
        yield from runs_at(text, start, end)


def padded_end(text: str, end: int) -> int:
    """Where a run ending at `end` ends with its base64 padding (up to two `=`)."""
    padded = end
    while padded < len(text) and padded - end < 2 and text[padded] == "=":
        padded += 1
    return padded


def runs_at(text: str, start: int, end: int) -> Iterator[Run]:
    """The runs `runs` reads in one stretch of the alphabet, text[start:end] (a bound
    of `stretches`): they depend on it and its padding alone."""
    body = text[start:end]
    if len(body) >= MIN_HEX and _HEX.fullmatch(body):
        yield Run(start, end, "hex")
        return
    for inner in _HEX_INSIDE.finditer(body):  # hex behind other characters ("x" + hex)
        lo, hi = start + inner.start(), start + inner.end()
        for shift in (0, 1):
            if hi - lo - shift >= MIN_HEX:
                yield Run(lo + shift, hi - (hi - lo - shift) % 2, "hex")
    if body.lower() == body or body.upper() == body:
        # Base64 of 15 bytes or more without an upper or a lower case letter is
        # rare (random bytes: (38/64)^20 < 0.01 %; text: "dXNlcjpw..."), while paths
        # (/v1/chat/completions) and snake_case names are all one case.
        return
    padded = padded_end(text, end)
    # From its first character; a run short enough to be a key wrapped in a few more
    # characters ("x" + base64) also from its next three.
    for shift in range(4 if len(body) <= MAX_SHIFTED else 1):
        if len(body) - shift >= MIN_BASE64:  # (one character past a whole group: cut,
            # a stream's window ending in a run cuts it anywhere; a decoder reads the rest)
            yield Run(start + shift, padded if (len(body) - shift) % 4 != 1 else end - 1,
                      "base64")


def stretches(text: str) -> Iterable[tuple[int, int]]:
    """(start, end) of the runs of `MIN_BASE64` or more that `runs` reads: those the C
    check lists (`fastscan.key_runs`, one pass: the others are one case without 32 hex
    digits, and yield nothing), else every one (after the cheap check, `key_run`)."""
    listed = key_runs(text)
    if listed is not None:
        return listed
    return _every_run(_mapped(text)) if key_run(text) else ()


def _every_run(mapped: bytes) -> Iterator[tuple[int, int]]:
    at = mapped.find(_NEEDLE)
    while at != -1:
        start = mapped.rfind(b" ", 0, at) + 1
        end = mapped.find(b" ", at)
        end = len(mapped) if end == -1 else end
        at = mapped.find(_NEEDLE, end)
        yield start, end


def decode_run(text: str, run: Run) -> bytes | None:
    """The bytes a run encodes (None if it does not decode)."""
    body = text[run.start:run.end]
    try:
        if run.kind == "hex":
            return binascii.unhexlify(body)
        body = body.rstrip("=").replace("-", "+").replace("_", "/")
        return base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None


def encode_run(text: str, run: Run, data: bytes) -> str:
    """`data` in the same encoding as the run it came from (alphabet, case, padding)."""
    old = text[run.start:run.end]
    if run.kind == "hex":
        out = data.hex()
        return out.upper() if old.upper() == old and not old.isdigit() else out
    out = base64.b64encode(data).decode("ascii")
    if "-" in old or "_" in old:
        out = out.replace("+", "-").replace("/", "_")
    return out if old.endswith("=") else out.rstrip("=")


# (str.lstrip's whitespace in latin-1, then what starts a JSON document)
# (JSON's start after what Python's `str.strip` takes, and a UTF-8 byte-order mark,
# which a JSON reader of bytes skips)
# (possessive: written `ws* BOM? ws*`, a body of whitespace took quadratic time, 1.2 s
# for 16 KB, as each way of sharing it between the two runs was tried)
_JSON_START = re.compile(rb"[\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0]*+"
                         rb"(?:\xef\xbb\xbf[\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0]*+)?[\[{]")


def body_kind(body: bytes, ctype: str) -> str:
    """How a receiver reads a body: `form`, `json` (by its type, or a body starting
    with `{` or `[`) or `text`, as it is (`prefilter.ESCAPES` says what each undoes)."""
    if "x-www-form-urlencoded" in ctype:
        return "form"
    return "json" if "json" in ctype or _JSON_START.match(body) else "text"


_CHARSET = re.compile(r";\s*charset\s*=\s*\"?([^\s;\"]+)", re.IGNORECASE)
_PRINTABLE = bytes(range(0x20, 0x7F))
_STATEFUL = ("utf_7", "iso2022", "hz")  # codecs whose escapes turn ASCII bytes into other text
# Python's codecs that are no charset a receiver names, and turn ASCII escapes into other
# text (`\x67hp_...`) or cannot read every byte: refused, as a charset without a codec.
_NOT_CHARSETS = frozenset({"unicode_escape", "raw_unicode_escape", "punycode", "idna",
                           "undefined"})
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
# The charsets that name no byte order: the byte-order marks that give one.
_ORDERLESS = {"utf-16": (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE),
              "utf-32": (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)}


def text_codec(body: bytes, ctype: str) -> str:
    """The codec to read a body that is not JSON with, as its receiver reads it: the
    Content-Type's charset where a key could hide from a reading of the bytes as they
    are (UTF-16, UTF-32, UTF-7, ISO-2022, EBCDIC: ASCII is not its own bytes there),
    else a UTF-16/32 byte-order mark, else latin-1 (the bytes as they are: UTF-8 and
    every ASCII superset). Raises Unreadable for a charset there is no codec for."""
    named = _CHARSET.findall(ctype)
    if len({charset.lower() for charset in named}) > 1:  # (a reader takes the first, or
        raise Unreadable("the body's Content-Type names more than one charset ("  # the last)
                         + ", ".join(repr(c[:40]) for c in named[:4]) + "); name one")
    found = _CHARSET.search(ctype)
    if found is not None:
        try:  # (LookupError: no codec, or one of bytes to bytes: `hex`, `zlib`)
            name = codecs.lookup(found.group(1)).name
            if name.replace("-", "_") in _NOT_CHARSETS:
                raise LookupError(name)
            printable = _PRINTABLE.decode(name, "replace")
        except (LookupError, UnicodeError):
            raise Unreadable(f"the body's charset {found.group(1)[:40]!r} is none the "
                             "gateway can read") from None
        if name in _ORDERLESS and not body.startswith(_ORDERLESS[name]):
            # (Python reads it little-endian, RFC 2781 big-endian: either could be the
            # receiver's, and a key in one order is noise in the other)
            raise Unreadable(f"the body's charset {found.group(1)[:40]!r} names no byte "
                             "order and the body starts with no byte-order mark; send it "
                             "with one, or name the order (utf-16le, utf-16be, ...)")
        if name.replace("-", "_").startswith(_STATEFUL) or \
                printable.encode("latin-1", "replace") != _PRINTABLE:
            return name
        return "latin-1"
    for bom, name in _BOMS:
        if body.startswith(bom):
            return name
    return "latin-1"


def json_codec(body: bytes) -> str:
    """The codec to read a JSON body's text with: latin-1 for UTF-8 (offsets stay byte
    offsets; JSON strings are parsed from the bytes), else the UTF-16 or UTF-32 a
    JSON reader (`json.loads`) finds by its first bytes."""
    # (no byte-order mark, no NUL in the first four bytes: UTF-8. `find`, not `in`:
    # core/leaks.py `_plain`)
    if (not body or body[0] < 0xFE) and body.find(b"\x00", 0, 4) < 0:
        return "latin-1"
    found = json.detect_encoding(body)
    return "latin-1" if found.startswith("utf-8") else found
