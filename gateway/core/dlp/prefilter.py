"""One multi-pattern pass over a text for every detector's anchors (Aho-Corasick, the
automaton the leak guard uses): a text without an anchor costs one C-speed pass and no
regular expression runs. Around each anchor found, only that anchor's rules run, on a
window bounded by the rule's reach; overlapping windows are merged.

Anchors are case-sensitive literals (a case-insensitive pattern lists its case variants,
see the library). The text searched is the decoded view a detector reads; the gate over
a raw body (`gate`) first undoes %XX and JSON `\\u00XX` escapes, so an escaped anchor is
not missed by the cheap check.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import ahocorasick

from gateway.core.dlp.detector import Detector, Rule, Span

__all__ = ["Prefilter", "unescape"]

_PERCENT = re.compile(r"%([0-9A-Fa-f]{2})")
_JSON_U = re.compile(r"\\u00([0-9A-Fa-f]{2})")


def _byte(match: re.Match[str]) -> str:
    return chr(int(match.group(1), 16))


def unescape(text: str) -> str:
    """`text` with %XX (twice) and JSON `\\u00XX` escapes and `\\/` undone: what a
    receiver may read out of it (a gate's view, not a detector's)."""
    for _ in range(2):
        if "%" not in text:
            break
        text = _PERCENT.sub(_byte, text)
    if "\\" in text:
        text = _JSON_U.sub(_byte, text).replace("\\/", "/")
    return text


# An entry of the automaton: a key (a suffix of one or more anchors) and, for each anchor
# it stands for, the anchor, the key's offset in it and the anchor's rules.
_Entry = tuple[int, tuple[tuple[str, int, tuple[tuple[str, Rule], ...]], ...]]
MIN_KEY = 3  # characters of an anchor the automaton searches for (all of a shorter one)


class Prefilter:
    """The anchors of some detectors, in one automaton, and the rules with no anchor.

    pyahocorasick's cost per character grows with the number of distinct first
    characters of its keys (about 20 for the default anchors: 18 µs for 2 KB, against
    6 µs with one), so the automaton holds, for each anchor, its longest suffix starting
    with one of a few "pivot" characters chosen to cover every anchor (13 for the
    defaults: about a fifth less time); a key found is checked against the whole anchor
    before its rules run."""

    def __init__(self, detectors: tuple[Detector, ...]) -> None:
        self.detectors = detectors
        self.unanchored: tuple[tuple[str, Rule], ...] = tuple(
            (d.name, r) for d in detectors for r in d.rules if not r.anchors)
        table: dict[str, list[tuple[str, Rule]]] = defaultdict(list)
        for d in detectors:
            for rule in d.rules:
                for anchor in rule.anchors:
                    table[anchor].append((d.name, rule))
        keys: dict[str, list[tuple[str, int, tuple[tuple[str, Rule], ...]]]] = defaultdict(list)
        for anchor, offset in _keys(sorted(table)).items():
            keys[anchor[offset:]].append((anchor, offset, tuple(table[anchor])))
        self._automaton: Any = None
        if keys:
            automaton = ahocorasick.Automaton()
            for key, entries in keys.items():
                automaton.add_word(key, (len(key), tuple(entries)))
            automaton.make_automaton()
            self._automaton = automaton

    def _anchors(self, text: str) -> Iterator[tuple[int, str, tuple[tuple[str, Rule], ...]]]:
        """(start, anchor, rules) of every anchor in `text`."""
        entry: _Entry
        for end, entry in self._automaton.iter(text):
            size, entries = entry
            for anchor, offset, rules in entries:
                start = end - size + 1 - offset
                if start >= 0 and (not offset or text.startswith(anchor, start)):
                    yield start, anchor, rules

    def any(self, text: str) -> bool:
        """Whether `text` holds any anchor (or some detector has none)."""
        if self.unanchored:
            return True
        return self._automaton is not None and next(self._anchors(text), None) is not None

    def spans(self, text: str) -> list[Span]:
        """Every value any detector finds in `text`, by position."""
        windows: dict[tuple[str, Rule], list[tuple[int, int]]] = defaultdict(list)
        if self._automaton is not None and text:
            for start, anchor, rules in self._anchors(text):
                end = start + len(anchor)
                for name, rule in rules:
                    windows[(name, rule)].append(
                        (max(0, start - rule.before), min(len(text), end + rule.after)))
        found: set[Span] = set()
        for (name, rule), spans in windows.items():
            for lo, hi in _merged(spans):
                found.update(rule.spans(name, text, lo, hi))
        for name, rule in self.unanchored:
            found.update(rule.spans(name, text, 0, len(text)))
        return _outermost(sorted(found, key=lambda s: (s.start, -s.end, s.detector)))


def _keys(anchors: list[str]) -> dict[str, int]:
    """For each anchor, the offset of the suffix the automaton searches for: pivot
    characters picked greedily (the one starting a suffix of at least `MIN_KEY`
    characters in most anchors not yet covered, ties by character order), each anchor's
    suffix the longest starting with a pivot."""
    def starts(anchor: str, char: str) -> list[int]:
        return [i for i, c in enumerate(anchor)
                if c == char and len(anchor) - i >= min(MIN_KEY, len(anchor))]

    chars = sorted({c for a in anchors for c in a})
    pivots: list[str] = []
    left = set(anchors)
    while left:
        best = max(chars, key=lambda c: (sum(1 for a in left if starts(a, c)), -ord(c)))
        pivots.append(best)
        left = {a for a in left if not starts(a, best)}
    return {a: min(i for c in pivots for i in starts(a, c)) for a in anchors}


def _outermost(spans: list[Span]) -> list[Span]:
    """Spans without those inside another span of the same detector (two patterns of one
    detector matching one key: the longer match is the key)."""
    out: list[Span] = []
    for span in spans:
        if not any(o.detector == span.detector and o.start <= span.start and span.end <= o.end
                   for o in out[-8:]):
            out.append(span)
    return out


def _merged(windows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(windows):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
