"""A multipart body split as its reader splits it: each part's name, head, content and
own type and coding (the scanner reads each part by them), and what lies outside the
parts (a preamble, an epilogue, or the whole body where the delimiter is not in it: a
receiver that stores the body as it came, an object store, keeps those too). Pure."""

from __future__ import annotations

import base64
import binascii
import quopri
import re
from collections.abc import Iterator
from typing import NamedTuple

from gateway.core.dlp.decoding import Unreadable, text_codec

__all__ = ["Part", "StreamedParts", "as_sent", "boundary", "outside", "parts"]

_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)
_PART_NAME = re.compile(rb'\bname="([^"]*)"', re.IGNORECASE)


class Part(NamedTuple):
    name: str  # its form field name (`name="..."`, 80 characters at most), else `#index`
    head: bytes
    content: bytes  # as sent (its `coding` not undone)
    ctype: str  # its own Content-Type as sent ("" where it has none)
    coding: str | None  # its own Content-Encoding
    transfer: str = ""  # its Content-Transfer-Encoding, lower case (MIME: base64, ...)


def boundary(ctype: str) -> bytes | None:
    """The delimiter a `multipart/...` Content-Type names (None: it names none). Raises
    Unreadable where it names two that differ (a reader takes the first or the last)."""
    named = _BOUNDARY.findall(ctype)
    if len(set(named)) > 1:
        raise Unreadable("the body's Content-Type names more than one multipart boundary; "
                         "name one")
    return b"--" + named[0].encode("latin-1") if named else None


def outside(body: bytes, delimiter: bytes) -> bytes:
    """What no part holds: the preamble and the epilogue, joined by a newline (the
    whole body where `delimiter` is not in it)."""
    first = body.find(delimiter)
    if first < 0:
        return body
    end = body.find(delimiter + b"--", first)
    return body[:first] + (b"\n" + body[end + len(delimiter) + 2:] if end >= 0 else b"")


def parts(body: bytes, delimiter: bytes) -> Iterator[Part]:
    """The parts between `delimiter`s, up to the closing one (CRLF or bare LF heads)."""
    for index, chunk in enumerate(body.split(delimiter)[1:]):
        if chunk.startswith(b"--"):
            break
        head, cut, content = chunk.partition(b"\r\n\r\n")
        if not cut:
            head, _, content = chunk.partition(b"\n\n")
        content = content.removesuffix(b"\r\n").removesuffix(b"\n")
        found = _PART_NAME.search(head)
        name = found.group(1).decode("latin-1")[:80] if found else f"#{index}"
        ctype, codings, transfer = "", [], ""
        for key, value in _fields(head):
            if key == "content-type":
                ctype = value  # (as sent: a nested multipart's boundary keeps its case)
            elif key == "content-encoding":  # (a list: every line of it)
                codings.append(value)
            elif key == "content-transfer-encoding":
                transfer = value.lower()
        yield Part(name, head, content, ctype, ", ".join(codings) or None, transfer)


def _fields(head: bytes) -> Iterator[tuple[str, str]]:
    """A part head's fields: (name lower case, value as sent)."""
    for line in head.split(b"\n"):
        key, _, value = line.partition(b":")
        yield key.strip().lower().decode("latin-1"), value.strip().decode("latin-1")


def as_sent(part: Part) -> bytes:
    """A part's content with its MIME transfer encoding undone, as a receiver that
    decodes it reads it (quoted-printable hides `ghp_` as `=67hp_`; base64 lines wrapped
    at 76 characters cut a key's runs apart)."""
    if part.transfer == "quoted-printable":
        return quopri.decodestring(part.content)
    if part.transfer == "base64":
        try:
            return base64.b64decode(part.content, validate=False)
        except binascii.Error:  # (its padding: a receiver cannot read it either)
            raise Unreadable(f"multipart part {part.name!r}'s base64 does not decode") \
                from None
    return part.content


_HEAD_MAX = 16 << 10  # bytes a streamed part's head may take
_READ_AS_TEXT = frozenset({"", "7bit", "8bit", "binary"})  # transfer encodings kept


class StreamedParts:
    """A multipart body streamed past the hold limit is read as text (its window, as it
    came): fed each piece, this raises Unreadable at a part whose head names what such
    a reading cannot undo (a content coding, a transfer encoding, a charset ASCII is not
    its own bytes in), looking only at the heads after each delimiter."""

    __slots__ = ("_delimiter", "_tail")

    def __init__(self, delimiter: bytes) -> None:
        self._delimiter = delimiter
        self._tail = b""

    def feed(self, piece: bytes) -> None:
        data, delimiter = self._tail + piece, self._delimiter
        keep = max(0, len(data) - len(delimiter) - 4)  # (a delimiter cut across pieces)
        at = data.find(delimiter)
        while at >= 0:
            start = at + len(delimiter)
            end = min((i for i in (data.find(b"\r\n\r\n", start), data.find(b"\n\n", start))
                       if i >= 0), default=-1)
            if end < 0:
                if len(data) - start > _HEAD_MAX:
                    raise Unreadable("a streamed multipart part's head is longer than "
                                     f"{_HEAD_MAX} bytes")
                keep = min(keep, at)  # (its head is still coming)
                break
            _check(data[start:end])
            at = data.find(delimiter, end)
        self._tail = data[keep:]


def _check(head: bytes) -> None:
    for key, value in _fields(head):
        if key == "content-encoding" and any(
                c.strip().lower() not in ("", "identity") for c in value.split(",")):
            raise Unreadable(f"a multipart part of a streamed body names content coding "
                             f"{value[:40]!r}, which a stream is not decoded from; send it "
                             "within the hold limit, or uncoded")
        if key == "content-transfer-encoding" and value.lower() not in _READ_AS_TEXT:
            raise Unreadable(f"a multipart part of a streamed body names transfer encoding "
                             f"{value[:40]!r}; send it within the hold limit, or as binary")
        if key == "content-type" and "charset" in value.lower() and \
                text_codec(b"", value.lower()) != "latin-1":
            raise Unreadable("a multipart part of a streamed body names a charset ASCII "
                             "is not its own bytes in; send it within the hold limit")
