"""What a sandbox sent before (issue 43): the strings of its JSON bodies found to hold
nothing, remembered so that a conversation sent again every turn is read for what is new.

A coding agent's request carries its whole conversation: the system prompt, the tool
definitions, every file it read and every answer, again at each turn, growing. Read
whole, each turn costs the conversation's length; here a long string (`SHORTEST` bytes
or more, as sent) that a scan of this sandbox's found holding nothing is remembered
(`_jsontext.Memo`: its bytes, compared whole), and the next body's first reading leaves
it out: the scan reads the new strings, and what was left out is said (`Reading`).

What is left out could have mattered to a scan in two ways, and both are kept:

* a window read around an anchor in a string beside it, reaching into it (a private
  key's header in one string and its body in the next): where a window of the reading
  holds a place a string was left out of, the body is read whole instead
  (`Prefilter.reading` answers None);
* the rules that read a name beside its value read the document's text whole: a string
  left out that holds one of their anchors makes that pass run (`named`).

A string is remembered only where nothing was found in the body, no window read crossed
its ends (so none of its own windows read another string, and no other string's window
read it), and every run in it decoded to nothing: what a scan finds in it depends on its
own characters alone, and was nothing. A string is remembered for one sandbox and one
selection of detectors (`tag`): what one sandbox sent is never what another's scan
skips, and a string clean for some detectors is read again by others. The memory is
bounded (`SLOTS` strings, `LIMIT` bytes; past it, it starts again): it changes what a
scan costs, never what it finds (tests/core/dlp/test_dlp_history.py holds the scans with
it to the scans without it over conversations of many turns).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from gateway.core.dlp import jsondoc
from gateway.core.dlp.decoding import Run
from gateway.core.dlp.findings import Hit, Location
from gateway.core.dlp.prefilter import Prefilter, merged, nested_json

__all__ = ["LIMIT", "SHORTEST", "SLOTS", "History", "Reading", "Scan"]

SHORTEST = 256  # bytes of a string as sent: a shorter one is read again each time
SLOTS = 4096  # strings remembered, at most
LIMIT = 8 << 20  # their bytes, at most


class Scan(Protocol):
    """What `History.first` reads with: a scanner (`scanner.Scanner`)."""

    prefilter: Prefilter
    selection: frozenset[str]
    string_anchors: frozenset[str] | None
    depth: int

    def decoded(self, text: str) -> Iterator[tuple[Run, str]]: ...

    def text_hits(self, text: str, location: Location, depth: int = 0) -> Iterator[Hit]: ...

    def run_hits(self, inner: str, where: Location, depth: int) -> Iterator[Hit]: ...


@dataclass(frozen=True, slots=True)
class Reading:
    """A JSON body's strings with those remembered left out: `text` (joined by newlines,
    as `jsondoc.joined`), `cuts` (where in it a string was left out), `fresh` (for each
    string long enough to remember: its characters in `text`, its bytes in the body),
    `named` (a string left out holds an anchor of the rules reading a name)."""

    text: str
    cuts: list[int]
    fresh: list[tuple[int, int, int, int]]
    named: bool


class History:
    """The strings remembered, for every sandbox and selection (see the module); a
    history of nothing where the C reading is not built (every body read whole)."""

    __slots__ = ("_memo",)

    def __init__(self, *, slots: int = SLOTS, limit: int = LIMIT,
                 shortest: int = SHORTEST) -> None:
        native = jsondoc.native()
        self._memo = native.Memo(slots, limit, shortest) if native is not None else None

    def read(self, body: bytes, tag: int) -> Reading | None:
        """The body's strings less those remembered for `tag`; None where it is not read
        so (no C reading, or one it declines: `jsondoc.joined` decides)."""
        if self._memo is None:
            return None
        found = self._memo.read(body, tag & 0xFFFF_FFFF_FFFF_FFFF)
        return None if found is None else Reading(*found)

    def first(self, scanner: Scan, body: bytes, sandbox: str, seen: set[str],
              later: list[Callable[[], None]]) -> bool | None:
        """Whether `scanner`'s first reading of a JSON body's strings finds anything,
        the long strings this sandbox sent before that held nothing left out; None: read
        the body whole (not read so, or a window reaches where a string was left out).
        `seen`: the anchors found; `later`: where nothing was found, what remembers the
        new strings that hold nothing, for the caller to call once the rest of its
        reading (the name rules' pass) has found nothing either."""
        tag = hash((sandbox, scanner.selection))
        reading = self.read(body, tag)
        found = None if reading is None else scanner.prefilter.reading(reading.text,
                                                                       reading.cuts)
        if reading is None or found is None:
            return None
        spans, anchors, windows = found
        seen.update(anchor for _, anchor in anchors)
        named = scanner.string_anchors
        if reading.named:
            seen.update(named or ())
        if spans:
            return True
        if scanner.depth > 0:  # (what `Scanner.parts_hits` reads after the spans)
            for run, inner in scanner.decoded(reading.text):
                if next(scanner.run_hits(inner, Location("body", via=(run.kind,)), 1),
                        None) is not None:
                    return True
        nested = next(nested_json(reading.text), None)  # (and JSON inside a string, each
        if nested is not None and next(scanner.text_hits(nested, Location("body")),  # level
                                       None) is not None:  # in: `Scanner.parts_hits`)
            return True
        later.append(partial(self.remember, body, reading, tag, windows, anchors, named))
        return False

    def remember(self, body: bytes, reading: Reading, tag: int,
                 windows: list[tuple[int, int]], anchors: list[tuple[int, str]],
                 named: frozenset[str] | None) -> None:
        """After a scan of `reading` found nothing: its fresh strings that no window
        crossed (`windows`: every one read; a window crosses a string where one of the
        string's ends lies inside it), each with whether it holds one of the `named`
        anchors (None: that pass always runs). In time of the strings and windows times
        their logarithm (a body of thousands of each, made to cost, is no square)."""
        assert self._memo is not None
        tag &= 0xFFFF_FFFF_FFFF_FFFF
        spans = merged(windows)  # (a point strictly inside the union may be an end two
        # windows share: such a string is not remembered, which only costs)
        starts = [lo for lo, _ in spans]
        marks = sorted(at for at, anchor in anchors if named is not None and anchor in named)
        for start, end, raw_start, raw_end in reading.fresh:
            if _inside(spans, starts, start) or _inside(spans, starts, end):
                continue
            holds = bisect_left(marks, start) < bisect_left(marks, end)
            self._memo.remember(body, raw_start, raw_end, tag, holds)

    def forget(self) -> None:
        if self._memo is not None:
            self._memo.forget()

    def size(self) -> tuple[int, int]:
        """(strings held, their bytes)."""
        if self._memo is None:
            return 0, 0
        held, size = self._memo.size()
        return held, size


def _inside(spans: list[tuple[int, int]], starts: list[int], point: int) -> bool:
    """Whether `point` lies strictly inside one of `spans` (disjoint, in order)."""
    i = bisect_right(starts, point) - 1
    return i >= 0 and spans[i][0] < point < spans[i][1]
