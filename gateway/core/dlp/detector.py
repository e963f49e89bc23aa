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

**A rule's expressions run with a time bound.** Python's `re` backtracks and cannot be
stopped: a text made for an expression costs what it costs, on the event loop (npm's
`//.+/:_authToken=…` over 52 KB of `//t` and anchors: 1.2 s, quadratic; a MiB, minutes).
The patterns are run by the `regex` module (the same syntax and answers: a rule's
pattern is compiled again from its source and flags; tests hold the two to the same
matches) with a deadline: a scan's (`Budget`: `SECONDS` and `PER_MIB` of what it reads),
else the text's own. The bound is the scan's thread's CPU time: `regex`'s timeout counts
wall-clock time, so where it fires before the thread has spent its time (descheduled,
on a loaded machine) the window is read again with what is left (`later`). Past it the
text is unreadable (refused where `dlp:` applies: fail closed). Ordinary text takes
microseconds of it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextvars import ContextVar, Token
from dataclasses import dataclass
from time import monotonic, thread_time
from types import TracebackType
from typing import Any

from gateway.core.dlp.decoding import Unreadable

__all__ = ["PER_MIB", "SECONDS", "SMALL", "Budget", "Detector", "Rule", "Span", "bounded",
           "deadline", "later", "left", "limit"]

SECONDS = 0.25  # what a scan's expressions may take, at least
PER_MIB = 1.0  # and this much more for each MiB it reads
# A window this short runs without `regex`'s timeout (which costs 1.5 µs a call, more
# than the call: an agent's request reads a few such windows), the deadline checked
# before it instead: its worst (npm's quadratic pattern over it, 0.2 ms; keyword's,
# always timed, 23 ms) is what a deadline may be overshot by.
SMALL = 1024
_FREE: dict[str, float] = {}  # (no timeout)
# (the running scan's deadline by the wall clock, and by its thread's CPU time)
_DEADLINE: ContextVar[tuple[float, float] | None] = ContextVar("dlp_deadline", default=None)
_FLAGS = ("IGNORECASE", "MULTILINE", "DOTALL", "VERBOSE", "ASCII")  # (`re`'s, by name)


def _seconds(size: int) -> float:
    return SECONDS + PER_MIB * size / (1 << 20)


def deadline(size: int) -> float:
    """When (monotonic) the expressions reading a text of `size` characters must be
    done: the running scan's deadline (`Budget`), else one for this text alone."""
    running = _DEADLINE.get()
    return running[0] if running is not None else monotonic() + _seconds(size)


def later() -> float | None:
    """After a timeout: a new deadline where the running scan's thread has CPU time
    left (the wall clock ran on while it waited), else None (its time is spent)."""
    running = _DEADLINE.get()
    if running is None:
        return None
    spare = running[1] - thread_time()
    if spare <= 0:
        return None
    _DEADLINE.set((monotonic() + spare, running[1]))
    return monotonic() + spare


class Budget:
    """One scan's time for its expressions (`with Budget(size):`), over every text it
    reads (views, decoded runs, windows); a scan inside another keeps the outer's."""

    __slots__ = ("_size", "_token")

    def __init__(self, size: int) -> None:
        self._size = size
        self._token: Token[tuple[float, float] | None] | None = None

    def __enter__(self) -> None:
        if _DEADLINE.get() is None:
            seconds = _seconds(self._size)
            self._token = _DEADLINE.set((monotonic() + seconds, thread_time() + seconds))

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._token is not None:
            _DEADLINE.reset(self._token)


def bounded(pattern: Any) -> Any:
    """`pattern` (an `re` pattern, or a `regex` one) as a `regex` pattern. (`regex` is
    imported at the first rule made: a gateway without `dlp:` never maps its 1.9 MiB.)"""
    if pattern is None:
        return None
    import regex

    if isinstance(pattern, regex.Pattern):
        return pattern
    flags = 0
    for name in _FLAGS:
        if pattern.flags & getattr(re, name):
            flags |= getattr(regex, name)
    return regex.compile(pattern.pattern, flags)


def left(until: float) -> float:
    """Seconds to `until`, never negative (`regex` reads a negative timeout as none)."""
    return max(until - monotonic(), 0.0)


def limit(until: float, size: int) -> dict[str, float]:
    """The keywords bounding a `regex` call over `size` characters by `until`: its
    timeout, or for a short text (`SMALL`) none, the deadline checked now."""
    if size > SMALL:
        return {"timeout": max(until - monotonic(), 0.0)}
    if monotonic() >= until:
        raise TimeoutError
    return _FREE


def _late(name: str) -> Unreadable:
    return Unreadable(f"reading the text for {name} credentials took longer than its bound; "
                      "send it in parts")

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

    pattern: Any  # (a `regex` pattern: `bounded`, made so when the rule is)
    anchors: tuple[str, ...] = ()
    before: int = 0
    after: int = 256
    confirm: Callable[[str], bool] | None = None
    tail: Any = None  # (`regex`, as `pattern`)
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
    skip: Any = None  # (`regex`, as `pattern`)

    def __post_init__(self) -> None:
        for field in ("pattern", "tail", "skip"):
            object.__setattr__(self, field, bounded(getattr(self, field)))

    def _matches(self, text: str, start: int, end: int, until: float | None = None
                 ) -> Iterator[Any]:
        """What `finditer` finds in text[start:end], by `until` (monotonic; None:
        `deadline`); with `skip`, tried at the anchors (`_tried`; without, `finditer`
        itself)."""
        assert self.pattern is not None
        until = deadline(len(text)) if until is None else until
        if self.skip is None or len(self.anchors) != 1:  # (a full pass: no anchors)
            found: Iterator[Any] = self.pattern.finditer(text, start, end,
                                                         **limit(until, end - start))
            return found
        return self._tried(self.pattern, self.skip, text, start, end, until)

    def _tried(self, pattern: Any, skip: Any, text: str, start: int, end: int,
               until: float) -> Iterator[Any]:
        anchor, at = self.anchors[0], start
        while (found := text.find(anchor, at, end)) >= 0:
            match = pattern.match(text, found, end, **limit(until, end - found))
            if match is None:
                gone = skip.match(text, found, end, **limit(until, end - found))
                at = max(found + 1, gone.end() if gone is not None else 0)
                continue
            yield match
            at = max(match.end(), found + 1)

    def spans(self, name: str, text: str, start: int, end: int,
              until: float | None = None) -> Iterator[Span]:
        """Values this rule finds in text[start:end] (lookbehinds see before `start`),
        its expressions done by `until` (monotonic; None: `deadline(len(text))`, and
        past it while the scan's thread has CPU time left: `later`), else
        `Unreadable`."""
        until = deadline(len(text)) if until is None else until
        while True:  # (a value found before a timeout may be found again: callers keep sets)
            try:
                yield from self._spans(name, text, start, end, until)
                return
            except TimeoutError:
                more = later()
                if more is None:
                    raise _late(name) from None
                until = more

    def _spans(self, name: str, text: str, start: int, end: int, until: float
               ) -> Iterator[Span]:
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
        for match in self._matches(text, start, end, until):
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
                more = self.tail.match(text, hi, max(end, hi), **limit(until, end - hi))
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
