"""The C-speed passes every scanned text pays: where the detectors' anchors are
(`Literals`), and whether a text holds a run of 20 base64 characters (`has_segment`), the
two checks a text without candidates stops at.

Both run on Hyperscan (the `hyperscan` wheel: SIMD literal and bounded-repeat matching,
about 0.2 ms per MiB for the default anchors and 0.6 ms for the run check on prose).
Before it, the anchors were found by pyahocorasick's automaton (10 ms per MiB) and the
runs by `bytes.translate` and a search for 20 mapped characters (3 ms per MiB on prose,
whose letters are mostly in the base64 alphabet): a 100 MiB upload without candidates
cost twice as much CPU with detection as without. Where no wheel exists for the platform
(Linux on ARM), the automaton and the translate search are the fallback (`fast=False`);
both give the same answers (the tests run both).

A text is searched as latin-1 bytes at the same offsets (a character past latin-1 is `?`).

The gate's pass (`Gate`, `has_segment`: the run check, and the literals riding with it)
runs in C where `_gate.c` was built and the CPU has AVX2 (`NATIVE`): one loop over each
64-byte block answers both, 0.06 ms per MiB of prose for the run alone and 0.08-0.09
with the default detectors' literals (AVX-512 where the CPU has it), where Hyperscan's
database of the run and any literal runs two engines (0.10-0.20 and 0.21-0.30:
docs/performance.md); it also says which escapes a text holds (`escapes=True`), which
the leak guard and detection otherwise search for. Hyperscan stays for finding where the
anchors are (`Literals`) and for a gate the C loop does not take (a literal under three
bytes, more than 64 of them).
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from collections.abc import Iterator
from importlib.util import find_spec
from itertools import islice
from typing import Any

import ahocorasick

# The wheel is there (no wheel for Linux on ARM); imported at the first database built
# (`_hyperscan`): a process that never scans a body does not map its 1.5 MiB.
HYPERSCAN = find_spec("hyperscan") is not None
try:  # (built by `pip install` where a C compiler is, on x86-64: setup.py)
    import gateway.core.dlp._gate as _gate  # type: ignore[import-not-found]
except ImportError:
    _gate = None
NATIVE: bool = _gate is not None and bool(_gate.AVX2)  # the gate's pass in C (above)

__all__ = ["BACKSLASH", "ESCAPES_KNOWN", "FOUND", "HYPERSCAN", "LITERAL", "NATIVE", "PERCENT",
           "PLUS", "RUN", "UNMARKED", "ChunkPass", "Gate", "Literals", "as_bytes",
           "has_segment", "key_run", "key_runs"]
SEGMENT = 20  # base64 characters in a row that may hold a key (decoding.MIN_BASE64)
_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/_-"
MAP = bytes(0x61 if i in _ALPHABET else 0x20 for i in range(256))  # in the alphabet: "a"
_NEEDLE = b"a" * SEGMENT


def as_bytes(text: str | bytes | bytearray) -> bytes | bytearray:
    """`text` as bytes at the same offsets (bytes as they are: latin-1 already)."""
    return text.encode("latin-1", "replace") if isinstance(text, str) else text


def _hyperscan() -> Any:
    import hyperscan
    return hyperscan


class _Pool:
    """A Hyperscan database and scratch spaces for it: a scratch serves one scan at a
    time (a scan releases the GIL), so each scan takes one from the pool, cloned when
    none is free (a fraction of a microsecond)."""

    def __init__(self, expressions: list[bytes], flags: int | list[int], *,
                 literal: bool) -> None:
        hyperscan = _hyperscan()
        self._terminated = hyperscan.ScanTerminated
        self.db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
        self.db.compile(expressions=expressions, ids=list(range(len(expressions))),
                        elements=len(expressions), flags=flags, literal=literal)
        self._scratch = hyperscan.Scratch(self.db)
        self._free: list[Any] = []

    def scan(self, data: bytes | bytearray, on: Any, context: object = None) -> bool:
        """Calls `on` for each match (with `context`); False if `on` ended the scan
        (returned True)."""
        scratch = self._free.pop() if self._free else self._scratch.clone()
        try:
            # (any buffer: the extension reads it through the buffer protocol; its stub
            # says AnyStr. No `cast` call: this runs for every part of every request.)
            self.db.scan(data, match_event_handler=on, scratch=scratch,
                         context=context)
        except self._terminated:
            return False
        finally:
            self._free.append(scratch)
        return True


def _stop(_index: int, _start: int, _end: int, _flags: int, _context: object) -> bool:
    return True


_SEGMENTS: list[_Pool] = []


def has_segment(text: str | bytes | bytearray, *, fast: bool = HYPERSCAN,
                native: bool | None = None) -> bool:
    """Whether `text` holds `SEGMENT` characters of the base64 alphabets in a row (the
    cheap check before `decoding.runs`). `native`: the C pass (None: where `NATIVE`)."""
    if not fast:
        return _NEEDLE in as_bytes(text).translate(MAP)
    if NATIVE if native is None else native and NATIVE:
        return bool(_native_runs().flags(as_bytes(text)) & RUN)
    if not _SEGMENTS:
        _SEGMENTS.append(_Pool([rb"[A-Za-z0-9+/_\-]{%d}" % SEGMENT],
                               _hyperscan().HS_FLAG_SINGLEMATCH, literal=False))
    return not _SEGMENTS[0].scan(as_bytes(text), _stop)


def key_run(text: str | bytes | bytearray, *, native: bool | None = None) -> bool:
    """Whether `text` may hold a run `decoding.runs` decodes: the C check (`_gate.c`,
    `key_run_in`: a run of `SEGMENT` with both cases, or 32 hex digits of one case in a
    row; False: `runs` yields nothing) where built, else `has_segment`. `native`: None,
    where built; False, `has_segment` (tests)."""
    if _gate is not None and native is not False:
        return bool(_gate.key_run(as_bytes(text)))
    return has_segment(text)


def key_runs(text: str | bytes | bytearray, *, native: bool | None = None
             ) -> list[tuple[int, int]] | None:
    """The bounds of every run `decoding.runs` may decode (`key_run`'s), in order, where
    the C check is built; else None (`runs` reads every run)."""
    if _gate is not None and native is not False:
        found: list[tuple[int, int]] = _gate.key_runs(as_bytes(text))
        return found
    return None


RUN, LITERAL = 1, 2  # `Gate.flags`: SEGMENT base64 characters in a row; a gate's literal
FOUND = RUN | LITERAL  # (what a gate found, without the escapes)
# `Gate.flags(escapes=True)` on the C pass: the bytes a reader unescapes, known
# (ESCAPES_KNOWN) where it read the whole text (`_gate.c`); UNMARKED: no BOM, no NUL in
# the first four bytes (read as the bytes they are: `decoding.json_codec`)
PERCENT, BACKSLASH, PLUS, ESCAPES_KNOWN, UNMARKED = 4, 8, 16, 32, 128
UNDECIDED = 64  # the C pass gave up on a text made to keep its prefilter busy (`_gate.c`)
_NATIVE_RUNS: list[Any] = []


def _native_runs() -> Any:
    """The C gate without literals: the run check alone."""
    if not _NATIVE_RUNS:
        _NATIVE_RUNS.append(_gate.Gate(_ALPHABET, SEGMENT, []))
    return _NATIVE_RUNS[0]


def _native_gate(literals: tuple[tuple[str, bool], ...]) -> Any:
    """The C gate for `literals`, or None where it does not take them (ValueError: a
    literal under three bytes, more than 64)."""
    try:
        return _gate.Gate(_ALPHABET, SEGMENT,
                          [(w.encode("latin-1"), caseless) for w, caseless in literals])
    except ValueError:
        return None


class Gate:
    """One pass that answers the two questions asked of every body: whether it holds
    `SEGMENT` base64 characters in a row (`RUN`), and whether it holds one of some
    literals (`LITERAL`). The leak guard asks the first (every marker of a gateway
    token is such a run), outbound credential detection both (a run, or an anchor of a
    rule whose matches need no run: `Prefilter`). One Hyperscan database holds the
    run's pattern and the literals (compiled once per detector selection, about 20 ms);
    a pass costs about what the run check alone costs, the literals riding along.

    `flags(data, keep=True)` keeps the answer for that `bytes` object (the leak guard,
    which asks first); the next `flags` call on the same object takes it without a
    pass (detection, asking second of the same body), and one on another object drops
    it: an answer is only reused for the very object it was computed for (immutable
    bytes, held, so its identity cannot be reused)."""

    def __init__(self, literals: tuple[tuple[str, bool], ...] = (), *,
                 fast: bool = HYPERSCAN, native: bool | None = None) -> None:
        self.literals = literals  # (literal, caseless)
        self.fast = fast
        self._kept: tuple[bytes, int] | None = None
        self._pool: _Pool | None = None
        # The pass in C (`_gate.c`), where built and the literals suit it; else Hyperscan.
        # (`native`: None where `NATIVE`, read when the gate is made: tests turn it off.)
        self._native = (_native_gate(literals) if literals else _native_runs()) \
            if fast and (NATIVE if native is None else native and NATIVE) else None
        # Whether the pass is the C one, whose answer can say which escapes the text
        # holds (`flags(escapes=True)`). (An attribute: read on every body.)
        self.native = self._native is not None
        # The longest run or literal less one: what of one may lie before a piece of a
        # stream (`ChunkPass`).
        self.overlap = max([SEGMENT, *(len(w) for w, _ in literals)]) - 1
        self._finder = Literals(sorted({v for w, caseless in literals
                                        for v in (_cases(w) if caseless else (w,))}),
                                fast=False) if literals and not fast else None
        if fast and literals and self._native is None:  # (the run check alone: at its
            self._pool = self._compile()                 # first pass)

    def _compile(self) -> _Pool:
        expressions = [rb"[A-Za-z0-9+/_\-]{%d}" % SEGMENT] + [
            re.escape(w.encode("latin-1")) for w, _ in self.literals]
        hyperscan = _hyperscan()
        single = hyperscan.HS_FLAG_SINGLEMATCH
        flags = [single] + [single | (hyperscan.HS_FLAG_CASELESS if caseless else 0)
                            for _, caseless in self.literals]
        return _Pool(expressions, flags, literal=False)

    def forget(self) -> None:
        """Drop a kept answer (and the body it holds) that will not be asked for."""
        self._kept = None

    def flags(self, data: str | bytes | bytearray, *, keep: bool = False,
              escapes: bool = False) -> int:
        """`RUN | LITERAL` as found in `data` (see the class docstring for `keep`);
        `escapes`: also `ESCAPES_KNOWN` with `PERCENT`, `BACKSLASH` and `PLUS` where the
        pass read the whole text (the C pass, no run found; never on Hyperscan's)."""
        kept = self._kept
        if kept is not None:
            self._kept = None
            if kept[0] is data:
                return kept[1] if escapes else kept[1] & FOUND
        raw = as_bytes(data)
        native = self._native
        flags: int = native.flags(raw) if native is not None else UNDECIDED
        if flags & UNDECIDED:  # (no C pass, or a text it gave up on: see `_gate.c`)
            flags = self._library(raw)
        if keep and type(data) is bytes:
            self._kept = (data, flags)
        return flags if escapes else flags & FOUND

    def _library(self, raw: bytes | bytearray) -> int:
        """`RUN | LITERAL` by Hyperscan, or the fallback (the automaton, translate)."""
        pool = self._pool
        if pool is None and self.fast:  # (a process that never scans a body never maps
            pool = self._pool = self._compile()  # Hyperscan's 1.5 MiB)
        if pool is not None:
            found = [0]
            pool.scan(raw, _record, found)
            return found[0]
        return (RUN if has_segment(raw, fast=False) else 0) | \
            (LITERAL if self._finder is not None and self._finder.any(raw) else 0)

    def runs_clean(self, data: bytes) -> bool:
        """Whether every run `decoding.runs` reads in `data` decodes to nothing this gate
        finds (fewer than 12 bytes, or up to 3 KiB without a run or a literal: nothing a
        detector finds, nothing to decode again), in one C call (`_gate.c`,
        `runs_clean`); False: look (where there is no C pass, always: the Python
        reading decides)."""
        return self._native is not None and bool(self._native.runs_clean(data))

    def flags_after(self, before: bytes, data: bytes, *, escapes: bool = False) -> int:
        """`flags(data)`, and the runs and literals crossing into `data` from `before`
        (the end of a stream before it: at most 255 bytes), read with `data`'s first
        bytes. On the C pass one call, no slice or join (`ChunkPass`: every piece)."""
        native = self._native
        flags: int = native.flags(data, before) if native is not None else UNDECIDED
        if not flags & UNDECIDED:
            return flags if escapes else flags & FOUND
        flags = self._library(data)
        if before and not flags & RUN:  # (a run found: both askers have their answer)
            flags |= self._library(before + data[:len(before)])
        return flags


class ChunkPass:
    """A gate's pass over a stream, one chunk at a time: `flags(chunk)` says whether a run
    of `SEGMENT` or one of the gate's literals ends in the chunk, also one that begins
    in the chunks before it. A streamed request body is asked this once per chunk, and
    the answer serves both checks that read it (issue 43): the leak guard's window
    (`leaks.StreamScan`, which wants `RUN`) and outbound credential detection's
    (`stream.StreamScanner`, either flag), where each used to make a pass of its own.

    The chunk is scanned as it is, and the seam with the stream before it apart (the
    last `overlap` bytes before the chunk and its first `overlap`: every run or literal
    crossing the seam lies within them; `Gate.flags_after`: one C call), so no chunk is
    copied. An answer may also count
    a run or a literal that ended within the `overlap` bytes before the chunk (already
    counted for the chunk before): a reader takes a set flag as "look", never as proof."""

    __slots__ = ("_edge", "gate", "overlap")

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.overlap = gate.overlap
        self._edge = b""  # the stream's last `overlap` bytes

    def flags(self, chunk: bytes, *, escapes: bool = False) -> int:
        """`RUN | LITERAL` of the runs and literals ending in `chunk` (the next one of
        the stream; see the class docstring); `escapes`: as `Gate.flags`, of the chunk."""
        edge, overlap = self._edge, self.overlap
        self._edge = chunk[-overlap:] if len(chunk) >= overlap else (edge + chunk)[-overlap:]
        return self.gate.flags_after(edge, chunk, escapes=escapes) if chunk else 0


def _record(index: int, _start: int, _end: int, _flags: int, found: list[int]) -> bool:
    """A gate's match: the run (id 0) or a literal; a run decides both askers: stop."""
    found[0] |= LITERAL if index else RUN
    return bool(found[0] & RUN)


def _cases(word: str) -> tuple[str, ...]:
    """Every ASCII case variant of `word` (a caseless literal, for the automaton)."""
    out = [""]
    for c in word:
        out = [o + v for o in out for v in ({c.lower(), c.upper()} if c.isalpha() else {c})]
    return tuple(out)


class Literals:
    """Where some literal strings are in a text: Hyperscan's literal matcher, or
    (`fast=False`) the automaton (`_Automaton`)."""

    def __init__(self, literals: list[str], *, fast: bool = HYPERSCAN) -> None:
        self.literals = literals
        self._pool = _Pool([w.encode("latin-1") for w in literals], 0, literal=True) \
            if fast else None
        self._automaton = None if fast else _Automaton(literals)

    def find(self, text: str | bytes | bytearray, limit: int | None = None
             ) -> list[tuple[int, str]] | None:
        """(start, literal) of every literal in `text`, by end; None where there are
        more than `limit` (the search stops there)."""
        if self._automaton is not None:
            text = text if isinstance(text, str) else text.decode("latin-1")
            every = list(islice(self._automaton.find(text), None if limit is None else limit + 1))
            return every if limit is None or len(every) <= limit else None
        most = limit if limit is not None else sys.maxsize
        assert self._pool is not None
        found: list[tuple[int, str]] = []
        literals = self.literals

        def on(index: int, _start: int, end: int, _flags: int, _context: object) -> bool:
            literal = literals[index]
            found.append((end - len(literal), literal))
            return len(found) > most  # (True: the scan ends, one past the limit)

        return found if self._pool.scan(as_bytes(text), on) else None

    def any(self, text: str | bytes | bytearray) -> bool:
        if self._automaton is not None:
            text = text if isinstance(text, str) else text.decode("latin-1")
            return next(self._automaton.find(text), None) is not None
        assert self._pool is not None
        return not self._pool.scan(as_bytes(text), _stop)


# An entry of the automaton: a key (a suffix of one or more literals) and, for each
# literal it stands for, the literal and the key's offset in it.
_Entry = tuple[int, tuple[tuple[str, int], ...]]
MIN_KEY = 3  # characters of a literal the automaton searches for (all of a shorter one)


class _Automaton:
    """The fallback: pyahocorasick. Its cost per character grows with the number of
    distinct first characters of its keys (about 20 for the default anchors: 18 µs for
    2 KB, against 6 µs with one), so it holds, for each literal, its longest suffix
    starting with one of a few "pivot" characters chosen to cover every literal (13 for
    the default anchors: about a fifth less time); a key found is checked against the
    whole literal."""

    def __init__(self, literals: list[str]) -> None:
        keys: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for literal, offset in _keys(literals).items():
            keys[literal[offset:]].append((literal, offset))
        self._automaton: Any = ahocorasick.Automaton()
        for key, entries in keys.items():
            self._automaton.add_word(key, (len(key), tuple(entries)))
        self._automaton.make_automaton()

    def find(self, text: str) -> Iterator[tuple[int, str]]:
        entry: _Entry
        for end, entry in self._automaton.iter(text):
            size, entries = entry
            for literal, offset in entries:
                start = end - size + 1 - offset
                if start >= 0 and (not offset or text.startswith(literal, start)):
                    yield start, literal


def _keys(literals: list[str]) -> dict[str, int]:
    """For each literal, the offset of the suffix the automaton searches for: pivot
    characters picked greedily (the one starting a suffix of at least `MIN_KEY`
    characters in most literals not yet covered, ties by character order), each
    literal's suffix the longest starting with a pivot."""
    def starts(literal: str, char: str) -> list[int]:
        return [i for i, c in enumerate(literal)
                if c == char and len(literal) - i >= min(MIN_KEY, len(literal))]

    chars = sorted({c for a in literals for c in a})
    pivots: list[str] = []
    left = set(literals)
    while left:
        best = max(chars, key=lambda c: (sum(1 for a in left if starts(a, c)), -ord(c)))
        pivots.append(best)
        left = {a for a in left if not starts(a, best)}
    return {a: min(i for c in pivots for i in starts(a, c)) for a in literals}
