"""A multipart body split as its reader splits it: each part's name, head, content and
own type and coding (the scanner reads each part by them), and what lies outside the
parts (a preamble, an epilogue, or the whole body where the delimiter is not in it: a
receiver that stores the body as it came, an object store, keeps those too), and the
views a scanner reads of it (`views`). Pure."""

from __future__ import annotations

import base64
import binascii
import quopri
import re
from collections.abc import Iterator
from typing import NamedTuple, Protocol

from gateway.core.dlp.decoding import Unreadable, decode_content, text_codec
from gateway.core.dlp.findings import Hit, Location

__all__ = ["MULTIPART_DEPTH", "Part", "StreamedParts", "as_sent", "boundary", "outside",
           "parts", "views"]

MULTIPART_DEPTH = 16  # multipart bodies nested in parts, at most (2,000 ran out of stack)

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
    its own bytes in), looking only at the heads after each delimiter; and gives each
    part's content as it comes, by the part's number (from 1: what the scan reads a
    part that is an archive by, unpacked, `stream.StreamScanner`). A part's content ends
    with the line break before the next delimiter."""

    __slots__ = ("_check", "_delimiter", "_head", "_tail", "part")

    def __init__(self, delimiter: bytes, check: bool = True) -> None:
        self._delimiter = delimiter
        self._check = check  # (the heads checked: False where only the contents count)
        self._tail = b""
        self._head = False  # (reading a part's head)
        self.part = 0  # (the part whose content comes: 0, the preamble)

    def feed(self, piece: bytes) -> list[tuple[int, bytes]]:
        data, delimiter = self._tail + piece, self._delimiter
        out: list[tuple[int, bytes]] = []
        at = 0
        while True:
            if self._head:
                end = min((i for i in (data.find(b"\r\n\r\n", at), data.find(b"\n\n", at))
                           if i >= 0), default=-1)
                if end < 0:
                    if len(data) - at > _HEAD_MAX:
                        raise Unreadable("a streamed multipart part's head is longer than "
                                         f"{_HEAD_MAX} bytes")
                    break  # (its head is still coming)
                if self._check:
                    _check(data[at:end])
                at = end + (4 if data.startswith(b"\r\n\r\n", end) else 2)
                self._head = False
            found = data.find(delimiter, at)
            if found < 0:  # (its last bytes may start a delimiter: kept for the next)
                safe = max(at, len(data) - len(delimiter) - 4)
                if self.part and safe > at:
                    out.append((self.part, data[at:safe]))
                at = safe
                break
            if self.part and found > at:
                out.append((self.part, data[at:found]))
            self.part += 1
            self._head = True
            at = found + len(delimiter)
        self._tail = data[at:]
        return out


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


class Reads(Protocol):
    """What reads a multipart body's views: a scanner (`scanner.Scanner`)."""

    limit: int

    def text_hits(self, text: str, location: Location, depth: int = 0) -> Iterator[Hit]: ...

    def body_views(self, body: bytes, ctype: str, where: Location, coding: str | None = None,
                   gated: bool = False, sandbox: str | None = None, nested: int = 0
                   ) -> Iterator[Hit]: ...


def views(scan: Reads, body: bytes, ctype: str, where: Location, nested: int) -> Iterator[Hit]:
    """A multipart body's views: each part's head, and its content by its own type and
    coding (MIME transfer encoding undone); what lies outside the parts as text (as JSON
    where it is a JSON document, which a receiver reading JSON whatever the type says
    reads so), and the whole body so where the type names no boundary."""
    if nested >= MULTIPART_DEPTH:  # (each level a Python frame or three: bounded)
        raise Unreadable(f"the body nests multipart parts deeper than {MULTIPART_DEPTH}")
    delimiter = boundary(ctype)
    if delimiter is None:
        yield from scan.body_views(body, "text/plain", where, nested=nested + 1)
        return
    rest = outside(body, delimiter)  # (a receiver storing the body keeps it too)
    if rest.strip():
        yield from scan.body_views(rest, "text/plain", _named(
            where, "multipart preamble or epilogue"), nested=nested + 1)
    for part in parts(body, delimiter):
        place = _named(where, f"multipart part {part.name}")
        yield from scan.text_hits(part.head.decode("latin-1"), place)
        content = as_sent(part)
        if part.coding:
            content = decode_content(content, part.coding, scan.limit)
        yield from scan.body_views(content, part.ctype, place, part.coding, nested=nested + 1)


def _named(where: Location, name: str) -> Location:
    return Location(where.part, f"{where.name} {name}" if where.name else name, None,
                    where.via)
