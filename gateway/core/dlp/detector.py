"""One detector: how to find its candidates cheaply and how to confirm them.

A detector is a list of `Rule`s. A rule with anchors is tried only around the places the
prefilter found one of its anchors (literal strings every match contains); a rule
without anchors runs over the whole text (opt-in detectors only). A rule confirms what
its pattern matched with the plugin's own check and detect-secrets' heuristic filters
(`confirm`: a JWT's parts must be base64 JSON; `<token>`, `${VAR}`, `abcdef...` are not
secrets) and may extend the value over what follows (`tail`: a PEM block to its END
line). The value is the pattern's longest group of at least 4 characters if it has one
(the secret of a `name = "secret"` pattern), else the whole match.

`Rule`s are built from detect-secrets plugins by `gateway/services/dlp/library.py`; the
core never imports the library (it imports `requests`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gateway.core.dlp.decoding import Unreadable

__all__ = ["Detector", "Rule", "Span"]

MIN_GROUP = 4  # a group shorter than this is part of the pattern (ghp, glcbt prefix)
# What a rule's matches in one window may read (their values with their tails, which the
# checks read again; PER_MATCH at least each), in characters: this many times the
# window, and at least MIN_WORK.
# A text made of one anchor over and over (`BEGIN PRIVATE KEY ` with no END, `eyJeyJ…`)
# gave each match a tail to the window's end: 128 KB cost 14 s, 1 MiB minutes. Past it,
# the text is refused as unreadable (fail closed), never read in part.
WORK = 4
MIN_WORK = 64 * 1024
PER_MATCH = 64  # (a match and its checks cost at least this: 1 MiB of `eyJa.` took 1 s)


@dataclass(frozen=True, slots=True)
class Span:
    """Where a value is in one text (start, end) and which detector found it."""

    detector: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Rule:
    """One pattern of a detector. `anchors` are case-sensitive literals; `before` and
    `after` bound how far a match may reach from an anchor's start and end."""

    pattern: re.Pattern[str] | None
    anchors: tuple[str, ...] = ()
    before: int = 0
    after: int = 256
    confirm: Callable[[str], bool] | None = None
    tail: re.Pattern[str] | None = None
    # A rule with no pattern: the plugin's own analyze_string, values located in the text
    # (detect-secrets plugins that are not regular-expression lists, e.g. keyword).
    values: Callable[[str], Iterator[str]] | None = None
    # Characters trimmed off a value's ends (a pattern that matches its delimiters), and
    # characters that end a value (a pattern that runs to the end of the line).
    strip: str = ""
    stop: str = ""
    # A pattern that reads a value with the name assigned to it ("aws_secret_access_key":
    # "..."): in a JSON document or a form, name and value are two strings, so such a
    # rule also runs over the document's text as a whole.
    context: bool = False
    # Every match of the pattern holds `fastscan.SEGMENT` characters of the base64
    # alphabets in a row (`ghp_` and 36 more): a text without such a run cannot hold one,
    # so the gate need not look for this rule's anchors (`Prefilter.gate`). Declared by
    # the library, checked against the pattern by tests/core/dlp/test_dlp_runs.py.
    run: bool = False
    # For a pattern that begins with its one anchor and whose failed attempt at an anchor
    # fails at every anchor up to where `skip` (matched there) ends (JWT's: `eyJ` and a
    # run of its class, which needs a `.` after the run): its matches are tried at the
    # anchors only, each run once. `finditer` tried every `eyJ` of a run of them, each
    # reading the run to its end: 128 KB of `eyJ` cost 3.6 s, 1 MiB nearly 4 minutes.
    skip: re.Pattern[str] | None = None

    def _matches(self, text: str, start: int, end: int) -> Iterator[re.Match[str]]:
        """What `finditer` finds in text[start:end]; with `skip`, tried at the anchors
        (`_tried`; without, `finditer` itself: no generator between on every window)."""
        assert self.pattern is not None
        if self.skip is None or len(self.anchors) != 1:  # (a full pass: no anchors)
            return self.pattern.finditer(text, start, end)
        return self._tried(self.pattern, self.skip, text, start, end)

    def _tried(self, pattern: re.Pattern[str], skip: re.Pattern[str], text: str,
               start: int, end: int) -> Iterator[re.Match[str]]:
        anchor, at = self.anchors[0], start
        while (found := text.find(anchor, at, end)) >= 0:
            match = pattern.match(text, found, end)
            if match is None:
                gone = skip.match(text, found, end)
                at = max(found + 1, gone.end() if gone is not None else 0)
                continue
            yield match
            at = max(match.end(), found + 1)

    def spans(self, name: str, text: str, start: int, end: int) -> Iterator[Span]:
        """Values this rule finds in text[start:end] (lookbehinds see before `start`)."""
        if self.values is not None:
            window = text[start:end]
            for value in set(self.values(window)):
                if self.confirm is not None and not self.confirm(value):
                    continue
                at = window.find(value)
                while value and at != -1:
                    yield Span(name, start + at, start + at + len(value))
                    at = window.find(value, at + len(value))
            return
        assert self.pattern is not None
        work = max(MIN_WORK, WORK * (end - start))
        for match in self._matches(text, start, end):
            lo, hi = match.span()
            best = 0
            for i in range(1, (self.pattern.groups or 0) + 1):
                g0, g1 = match.span(i)
                if g0 >= 0 and g1 - g0 >= MIN_GROUP and g1 - g0 > best:
                    lo, hi, best = g0, g1, g1 - g0
            while lo < hi and text[lo] in self.strip:
                lo += 1
            while hi > lo and text[hi - 1] in self.strip:
                hi -= 1
            if self.stop:
                hi = next((i for i in range(lo, hi) if text[i] in self.stop), hi)
            if hi <= lo:
                continue
            if self.tail is not None:
                more = self.tail.match(text, hi, max(end, hi))
                if more is not None:
                    hi = more.end()
            work -= max(hi - lo, PER_MATCH)
            if work < 0:
                raise Unreadable(f"the text holds more {name} candidates than the scan "
                                 "reads in it; send fewer, or it in parts")
            if self.confirm is not None and not self.confirm(text[lo:hi]):
                continue
            yield Span(name, lo, hi)


@dataclass(frozen=True, slots=True)
class Detector:
    """A named detector (see `catalogue.DETECTORS`) and its rules."""

    name: str
    rules: tuple[Rule, ...]

    @property
    def reach(self) -> int:
        """How far a match may reach from any of its anchors (the streaming window)."""
        return max((r.before + r.after for r in self.rules), default=0)
