"""A multipart body split as its reader splits it: each part's name, head, content and
own type and coding (the scanner reads each part by them), and what lies outside the
parts (a preamble, an epilogue, or the whole body where the delimiter is not in it: a
receiver that stores the body as it came, an object store, keeps those too). Pure."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import NamedTuple

from gateway.core.dlp.decoding import Unreadable

__all__ = ["Part", "boundary", "outside", "parts"]

_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)
_PART_NAME = re.compile(rb'\bname="([^"]*)"', re.IGNORECASE)


class Part(NamedTuple):
    name: str  # its form field name (`name="..."`, 80 characters at most), else `#index`
    head: bytes
    content: bytes  # as sent (its `coding` not undone)
    ctype: str  # its own Content-Type as sent ("" where it has none)
    coding: str | None  # its own Content-Encoding


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
        ctype, codings = b"", []
        for line in head.split(b"\n"):
            key, _, value = line.partition(b":")
            if key.strip().lower() == b"content-type":
                ctype = value.strip()  # (as sent: a nested multipart's boundary keeps its case)
            elif key.strip().lower() == b"content-encoding":  # (a list: every line of it)
                codings.append(value.strip().decode("latin-1"))
        yield Part(name, head, content, ctype.decode("latin-1"), ", ".join(codings) or None)
