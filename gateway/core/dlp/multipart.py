"""A multipart body split as its reader splits it: each part's name, head, content and
own type and coding (the scanner reads each part by them). Pure."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import NamedTuple

__all__ = ["Part", "boundary", "parts"]

_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)
_PART_NAME = re.compile(rb'\bname="([^"]*)"', re.IGNORECASE)


class Part(NamedTuple):
    name: str  # its form field name (`name="..."`, 80 characters at most), else `#index`
    head: bytes
    content: bytes  # as sent (its `coding` not undone)
    ctype: str  # its own Content-Type, lower case ("" where it has none)
    coding: str | None  # its own Content-Encoding


def boundary(ctype: str) -> bytes | None:
    """The delimiter a `multipart/...` Content-Type names (None: it names none)."""
    match = _BOUNDARY.search(ctype)
    return b"--" + match.group(1).encode("latin-1") if match is not None else None


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
        ctype, coding = b"", None
        for line in head.split(b"\n"):
            key, _, value = line.partition(b":")
            if key.strip().lower() == b"content-type":
                ctype = value.strip().lower()
            elif key.strip().lower() == b"content-encoding":
                coding = value.strip().decode("latin-1")
        yield Part(name, head, content, ctype.decode("latin-1"), coding)
