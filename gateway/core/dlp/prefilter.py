"""One multi-pattern pass over a text for every detector's anchors: a text without an
anchor costs one C-speed pass and no regular expression runs. Around each anchor found,
only that anchor's rules run, on a window bounded by the rule's reach; overlapping
windows are merged.

The pass is `fastscan.Literals` (Hyperscan; pyahocorasick's automaton where there is no
Hyperscan wheel).

Anchors are case-sensitive literals (a case-insensitive pattern lists its case variants,
see the library). The text searched is the decoded view a detector reads; the gate over
a raw body (`gate`) first undoes %XX and JSON `\\u00XX` escapes, so an escaped anchor is
not missed by the cheap check.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterator
from urllib.parse import unquote_plus

from gateway.core.dlp.decoding import Unreadable
from gateway.core.dlp.detector import Budget, Detector, Rule, Span, deadline
from gateway.core.dlp.fastscan import (
    BACKSLASH,
    ESCAPES_KNOWN,
    HYPERSCAN,
    LITERAL,
    PERCENT,
    PLUS,
    RUN,
    Gate,
    Literals,
    as_bytes,
)

__all__ = ["ESCAPES", "JSON_ESCAPE", "NESTED", "Prefilter", "holds_json_escape", "json_string",
           "json_unescape", "merged", "nested_json", "reader_texts", "unescape"]

# What a reader of each kind of view undoes that could make an anchor or a base64 run
# appear: a JSON reader `\uXXXX` and `\/` (its other escapes become characters that
# are in no anchor and cut a run, as their backslash does); a form reader `%XX` and `+`
# (a space: "BEGIN+PRIVATE+KEY"). A text is read as it is.
ESCAPES: dict[str, tuple[str, ...]] = {"text": (), "json": ("\\u", "\\/"),
                                       "form": ("%", "+")}
JSON_ESCAPE = re.compile(rb"\\(?:u[0-9A-Fa-f]{4}|/)")  # (an escape hiding a character)
_JSON_ESCAPE_TEXT_ANY = re.compile(r"\\(?:u[0-9A-Fa-f]{4}|/)")

_PERCENT = re.compile(r"%([0-9A-Fa-f]{2})")
_JSON_U = re.compile(r"\\u00([0-9A-Fa-f]{2})")


def _byte(match: re.Match[str]) -> str:
    return chr(int(match.group(1), 16))


def unescape(text: str) -> str:
    """`text` with %XX (twice) and JSON `\\u00XX` escapes and `\\/` undone: what a
    receiver may read out of it (a gate's view, not a detector's)."""
    for _ in range(2):  # (a pass that undid nothing leaves nothing for the next)
        if "%" not in text:
            break
        text, undone = _PERCENT.subn(_byte, text)
        if not undone:
            break
    if "\\" in text:  # (memchr)
        # One pass for both JSON escapes (a body of code has a backslash a line:
        # `str.replace("\\/", ...)` costs twice the pass). Where a `\\` or `/` was
        # undone the two in turn, as before: they may make a `\\/` the second undoes.
        made: list[str] = []
        once = _JSON_ESCAPE_TEXT.sub(lambda m: _json_byte(m, made), text)
        text = once if not made else _JSON_U.sub(_byte, text).replace("\\/", "/")
    return text


def json_unescape(text: str) -> str:
    """A JSON text with the escapes a JSON reader reads a character of its strings out
    of undone (`\\uXXXX`, `\\/`), each escape read whole from its backslash as that
    reader reads it (`\\\\u0061` is a backslash and `u0061`); an escape of a quote or a
    backslash is left as it is (the text keeps its structure)."""
    return _JSON_ANY_ESCAPE.sub(_json_char, text) if "\\" in text else text


_JSON_ANY_ESCAPE = re.compile(r"\\(?:u([0-9A-Fa-f]{4})|(.))", re.DOTALL)
_JSON_SIMPLE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n",
                "r": "\r", "t": "\t"}
NESTED = 4  # levels of JSON inside a string a view is read through, at most


def json_string(text: str) -> str:
    """`text` read as the inside of a JSON string, every escape undone (`\\\\` is a
    backslash, `\\"` a quote; an escape no reader knows kept): a JSON text inside a
    string (a tool call's `arguments`) one level in."""
    return _JSON_ANY_ESCAPE.sub(_string_char, text) if "\\" in text else text


def nested_json(text: str) -> Iterator[str]:
    """The readings of `text` one, two, ... `NESTED` levels of JSON string in, while
    one still holds an escape that hides a character (`\\u`, `\\/`): a JSON text in a
    JSON string (a tool call's arguments), in a header's value, in a base64 run, is read
    as the reader that parses it reads it (`\\u0067hp_...` is `ghp_...`)."""
    for _ in range(NESTED):
        if not holds_json_escape(text):
            return
        text = json_string(text)
        yield text


def holds_json_escape(text: str) -> bool:
    """Whether `text` holds an escape a JSON reader reads a character out of that could
    hide one (`\\uXXXX`, `\\/`; a backslash first looked for: memchr)."""
    return "\\" in text and _JSON_ESCAPE_TEXT_ANY.search(text) is not None


def _string_char(match: re.Match[str]) -> str:
    code, other = match.group(1), match.group(2)
    if code is not None:
        return chr(int(code, 16))
    return _JSON_SIMPLE.get(other, match.group(0))


def _json_char(match: re.Match[str]) -> str:
    code, other = match.group(1), match.group(2)
    if code is None:
        return "/" if other == "/" else match.group(0)
    char = chr(int(code, 16))
    return match.group(0) if char in '"\\' else char


# The anchors a text may hold, at most (ordinary text holds a few a MiB, random base64 a
# few hundred): past it, each one's window and its Python step (1 MiB of `AKIA`: 0.8 s)
# make the text one the scan does not read (unreadable, fail closed).
ANCHORS = 4096
ANCHOR_EVERY = 32  # (and one more for each this many characters)
# What a JSON text holds outside its strings (`Prefilter.string_anchors`).
_STRUCTURE = frozenset(' \t\r\n{}[]:,"-+.0123456789eEtruefalsnNaIiy')
_JSON_ESCAPE_TEXT = re.compile(r"\\(?:u00([0-9A-Fa-f]{2})|/)")


def _json_byte(match: re.Match[str], made: list[str]) -> str:
    """What `unescape` reads for a JSON escape; a `\\` or `/` it makes is noted."""
    hex_ = match.group(1)
    if hex_ is None:
        return "/"
    char = chr(int(hex_, 16))
    if char in "\\/":
        made.append(char)
    return char


class Prefilter:
    """The anchors of some detectors, found in one pass, and the rules with no anchor.
    `fast`: Hyperscan where it is installed, else the automaton (see `fastscan`)."""

    def __init__(self, detectors: tuple[Detector, ...], *, fast: bool = HYPERSCAN) -> None:
        self.detectors = detectors
        self.unanchored: tuple[tuple[str, Rule], ...] = tuple(
            (d.name, r) for d in detectors for r in d.rules if not r.anchors)
        # (rules by their index: a `Rule` hashes every field, a window's key an int)
        self._entries = tuple((d.name, r) for d in detectors for r in d.rules)
        table: dict[str, list[int]] = defaultdict(list)
        for index, (_, rule) in enumerate(self._entries):
            for anchor in rule.anchors:
                table[anchor].append(index)
        self._rules = {anchor: tuple(rules) for anchor, rules in table.items()}
        self._finder = Literals(sorted(table), fast=fast) if table else None
        # The gate (`candidate`): a run, or an anchor of a rule whose matches need no run
        # (`Rule.run`): a text without either holds no value and no run to decode.
        self.gate = Gate(_caseless(sorted({a for d in detectors for r in d.rules
                                           if not r.run for a in r.anchors})), fast=fast)

    def string_anchors(self) -> frozenset[str] | None:
        """The anchors, where each of them, wherever it is in a JSON document's text with
        its escapes of characters undone (`json_unescape`), lies in one string of it
        (so a search of the strings alone finds it); None where one may not: an anchor
        of what a JSON text holds outside its strings alone, or with a quote or a
        backslash, or a rule without anchors. (An anchor beginning with an escape's
        letter, `n`, `t`, ..., could be read off `\\n...` in the text and not in the
        string: that reading is not the receiver's, and is skipped with the rest.)"""
        anchors = frozenset(self._rules)
        if self.unanchored or any('"' in a or "\\" in a or set(a) <= _STRUCTURE
                                  for a in anchors):
            return None
        return anchors

    def any(self, text: str | bytes | bytearray) -> bool:
        """Whether `text` (or latin-1 bytes) holds any anchor (or some detector has
        none)."""
        if self.unanchored:
            return True
        return self._finder is not None and self._finder.any(text)

    def candidate(self, text: str | bytes | bytearray, kind: str = "text") -> bool:
        """Whether `text`, as a reader of `kind` (`ESCAPES`) reads it, may hold a value:
        a base64 run (`fastscan.SEGMENT` characters), an anchor of a rule whose matches
        hold no such run (the others' matches all hold one: `Rule.run`), or an escape
        that could hide either (JSON's in any text: every text is also read with them
        undone, as a lenient JSON reader reads it). One pass (`gate`; its answer for a
        body the leak guard already asked about is taken, not computed again). The
        escapes are looked for with `find` (memchr); a backslash then by `JSON_ESCAPE`.
        False means no detector and no decoded run can find anything in it."""
        data = text if type(text) is bytes else as_bytes(text)
        gate = self.gate
        if gate.native and not self.unanchored:  # (the C pass saw the escapes: no memchr)
            flags = gate.flags(data, escapes=True)  # (`data` is `text` if bytes: kept)
            if flags & (RUN | LITERAL) or not flags & ESCAPES_KNOWN:
                return True
            if flags & BACKSLASH and JSON_ESCAPE.search(data) is not None:
                return True  # (every text is read with JSON's escapes undone too)
            return kind == "form" and bool(flags & (PERCENT | PLUS))
        find = data.find  # (not `in`: CPython 3.12's raises and clears a TypeError first)
        if self.unanchored or (find(b"\\") >= 0 and JSON_ESCAPE.search(data)) \
                or (kind == "form" and (find(b"%") >= 0 or find(b"+") >= 0)):
            self.gate.forget()  # (an answer the leak guard kept is not needed: let it go)
            return True
        return self.gate.flags(text) != 0

    def spans(self, text: str, anchors: set[str] | None = None) -> list[Span]:
        """Every value any detector finds in `text`, by position (`anchors`: the
        anchors found are added to it)."""
        windows, where = self._windows(text)
        if anchors is not None:
            anchors.update(anchor for _, anchor in where)
        return self._matched(text, windows)

    def reading(self, text: str, cuts: list[int]
                ) -> tuple[list[Span], list[tuple[int, str]], list[tuple[int, int]]] | None:
        """`spans(text)`, the anchors found (start, anchor) and every window's reach
        (not cut at the text's ends: what it would read of a longer text), for a text
        some strings were left out of at `cuts` (`history`); None where a window reaches
        a cut (it would have read what was left out: read the whole text)."""
        reach: list[tuple[int, int]] = []
        windows, where = self._windows(text, reach)
        if cuts and any(_holds_cut(cuts, lo, hi) for lo, hi in reach):
            return None
        return self._matched(text, windows), where, reach

    def _windows(self, text: str, reach: list[tuple[int, int]] | None = None
                 ) -> tuple[dict[int, list[tuple[int, int]]], list[tuple[int, str]]]:
        """The windows to read, by rule index, and the anchors found (`reach`: each
        window before it is cut at the text's ends is added to it)."""
        windows: dict[int, list[tuple[int, int]]] = {}
        if self._finder is None or not text:
            return windows, []
        entries = self._entries
        size = len(text)
        found = self._finder.find(text, ANCHORS + size // ANCHOR_EVERY)
        if found is None:  # (each costs a window: a text made of anchors is refused)
            raise Unreadable("the text holds more anchors of the detectors than the scan "
                             "reads in it; send it in parts")
        where = found
        for start, anchor in where:
            end = start + len(anchor)
            for index in self._rules[anchor]:
                rule = entries[index][1]
                if reach is not None:
                    reach.append((start - rule.before, end + rule.after))
                window = (max(0, start - rule.before), min(size, end + rule.after))
                if index in windows:
                    windows[index].append(window)
                else:
                    windows[index] = [window]
        return windows, where

    def _matched(self, text: str, windows: dict[int, list[tuple[int, int]]]) -> list[Span]:
        found: set[Span] = set()
        if not windows and not self.unanchored:
            return []
        entries = self._entries
        with Budget(len(text)):  # (the scan's, or this text's own)
            until = deadline(len(text))
            for index, spans in windows.items():
                name, rule = entries[index]
                for lo, hi in merged(spans) if len(spans) > 1 else spans:
                    found.update(rule.spans(name, text, lo, hi, until))
            for name, rule in self.unanchored:
                found.update(rule.spans(name, text, 0, len(text), until))
        return _outermost(sorted(found, key=lambda s: (s.start, -s.end, s.detector)))


def _holds_cut(cuts: list[int], lo: int, hi: int) -> bool:
    """Whether [lo, hi) holds one of `cuts` (sorted; a cut at the text's end is held by
    a window reaching past it)."""
    i = bisect_left(cuts, lo)
    return i < len(cuts) and cuts[i] < hi


def _caseless(anchors: list[str]) -> tuple[tuple[str, bool], ...]:
    """`anchors` with every set of all the ASCII case variants of one word (a
    case-insensitive pattern's anchors, `aws`, `xox`) as that word, caseless."""
    words: dict[str, set[str]] = defaultdict(set)
    for anchor in anchors:
        words[anchor.lower()].add(anchor)
    out: list[tuple[str, bool]] = []
    for word, variants in sorted(words.items()):
        letters = sum(c.isalpha() for c in word)
        if letters and len(variants) == 2 ** letters:
            out.append((word, True))
        else:
            out.extend((v, False) for v in sorted(variants))
    return tuple(out)


def _outermost(spans: list[Span]) -> list[Span]:
    """Spans without those inside another span of the same detector (two patterns of one
    detector matching one key: the longer match is the key)."""
    out: list[Span] = []
    for span in spans:
        if not any(o.detector == span.detector and o.start <= span.start and span.end <= o.end
                   for o in out[-8:]):
            out.append(span)
    return out


def merged(windows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Windows merged where they overlap or touch, in order."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(windows):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def reader_texts(text: str, kind: str) -> list[str]:
    """A window's text as a JSON or form reader reads it, where that differs from the
    text (escapes undone; `either`: a JSON document sent as a form, read both ways): what
    the held body's reading undoes (`Scanner.body_views`), for a streamed window
    (`stream.StreamScanner`)."""
    out = []
    if kind != "form" and ("\\u" in text or "\\/" in text):  # (memchr; a text: as a
        # lenient JSON reader reads it)
        out.append(json_unescape(text))
    if kind in ("form", "either") and ("%" in text or "+" in text):
        out.append(unquote_plus(text, encoding="latin-1"))
    return out
