"""What of a request's head outbound credential detection must read (issue 43).

A client sends the same head again and again: its line, names and most values repeat,
and an SDK adds a few values new on every request (a content length, a W3C trace id, an
idempotency key). A part (the line, a name, a value) found clean holds nothing any
detector finds, whatever the other parts hold (none crosses the newline the scan joins
them with), so the parts found clean are remembered, and a head is read for its new parts
only: one gate pass over them joined; where it hits, the new parts asked together which
of them may hold something alone (the scanner's exact check, `Scanner._holding`: one
search for anchors over them all, then each part's runs), and the scan reads only the
fields that hold a part that is not clean.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain

__all__ = ["CLEAN_PART", "CLEAN_PARTS", "CleanParts"]

CLEAN_PARTS = 1024  # parts of heads remembered as clean, at most
CLEAN_PART = 256  # bytes: a longer part is passed again each time (bounds the memory)

Fields = list[tuple[bytes, bytes]]


class CleanParts:
    """One scanner's memory of head parts found clean: the lines as `str`, the fields'
    names and values as `bytes` (a `bytearray` is never remembered). `candidate`: the
    gate over bytes; `holding`: the exact check of some parts (those of them that may
    hold something alone, given the parts and their join)."""

    __slots__ = ("candidate", "holding", "seen")

    def __init__(self, candidate: Callable[[bytes], bool],
                 holding: Callable[[list[bytes], bytes], list[bytes]]) -> None:
        self.candidate = candidate
        self.holding = holding
        self.seen: set[bytes | str] = set()

    def unclean(self, method: str, target: str, fields: Fields) -> Fields | None:
        """None where the head holds no candidate; else the fields the scan must read
        (the request line is read with them: a scan always reads it). A target with an
        escape (%, +, \\) is not decided here (the scan reads its query and its line
        unescaped): every field is read."""
        line = f"{method} {target}"
        seen = self.seen
        known = line in seen  # (a line remembered holds no escape)
        if not known and ("%" in target or "+" in target or "\\" in target):
            return fields
        new: list[bytes] = []  # (the parts not seen before: most heads have none, or two)
        try:
            for name, value in fields:
                if name not in seen:
                    new.append(name)
                if value not in seen:
                    new.append(value)
        except TypeError:  # (a bytearray part: never remembered)
            new = [p for p in chain.from_iterable(fields)
                   if type(p) is not bytes or p not in seen]
        if known and not new:
            return None
        if not known:
            new.append(line.encode("latin-1", "replace"))
        clean = new
        joined = b"\n".join(new)
        if new and self.candidate(joined):
            holding = self.holding(new, joined)
            clean = [p for p in new if p not in holding] if holding else new
        if len(seen) + len(clean) > CLEAN_PARTS:
            seen.clear()
        seen.update(p for p in clean if type(p) is bytes and len(p) <= CLEAN_PART)
        if not known and len(line) <= CLEAN_PART and (clean is new or new[-1] in seen):
            seen.add(line)
        if len(clean) < len(new):
            return [f for f in fields if f[0] not in seen or f[1] not in seen]
        return None
