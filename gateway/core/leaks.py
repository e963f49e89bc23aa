"""Leak detection (tokens and keys going where they must not) and echo redaction.

**Detection** looks for byte markers of every sensitive value in every part of a
request a leak can hide in: the request line, header fields (also all values joined,
so a value split over two headers is seen whole), body chunks as they stream (a
window keeps the tail of the previous chunk), trailers and WebSocket messages.
Markers cover the common encodings: raw, base64 (standard and URL-safe, at each byte
alignment, so a value inside a longer base64 blob such as Basic auth is found), hex
and base32; data holding a NUL is read again without it (UTF-16 and UTF-32 text).
Before matching, the data is put in canonical form — `%XX` (also
double-encoded) and JSON `\\u00XX` escapes decoded, all lowercased — and so are the
markers, which covers URL-encoding, JSON escaping and swapped case. Compressed bodies
are decoded first (`encodings`).

The sensitive values of a gateway token are its constant JOSE header prefix, the
constant start of its claims (issuer and audience), and the payload and signature of
the sandbox's own token: the header is public, so a token sent without it
(`payload.signature`) is still a live credential. Content scanning cannot see a token
cut into many small pieces or re-encoded in a private way; token binding
(`tokens: … cidr`) is the defence that holds then.

**Redaction** replaces an injected key an upstream echoes back by `[REDACTED]` in a
response stream, chunk by chunk, holding back only a tail that could start a key.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

import ahocorasick

from gateway.core import leak_readings as readings
from gateway.core.archives import Allowance
from gateway.core.dlp.fastscan import (
    RUN,
    SEGMENT,
    Gate,
    Literals,
)
from gateway.core.encodings import EncodingError
from gateway.core.leak_forms import undone
from gateway.core.leak_stream import StreamScan, plain
from gateway.core.unpack_bounds import ExcessError
from gateway.core.zip_entries import holds_files, unpacked_files

__all__ = ["REDACTED", "LeakScan", "Redactor", "StreamScan"]

REDACTED = b"[REDACTED]"
_WIDE = ("utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be")  # (a key echoed as text)
_WIDE_SHORTEST = 8  # characters: a shorter piece is not redacted (as in the logs)
_EXPANSION = 6  # longest canonical-form expansion of one byte (`\u00XX`)
_GATED = 512  # bytes from which a body is first asked for a run (`LeakScan.find`)
_RUNS = Gate()  # the run check alone (a request without outbound credential detection)
_RUN_BYTES = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789+/_-")


class LeakScan:
    """One request's markers: `tokens` (never allowed anywhere but the credential
    carrier, which is emptied before scanning), `secrets` (keys not bound to the
    request's destination) and `own` (the markers of the client's own token).

    `tokens` and `secrets` are the same for every sandbox sending to one host: they are
    found in one pass by a literal matcher shared by every scan with the same markers
    (`_automaton`, a bounded number of them). `own` differs per token and is searched
    marker by marker (some twenty, a few µs per head), so a gateway serving many
    sandboxes holds no matcher per token."""

    __slots__ = ("_automaton", "keep", "marker_runs", "own", "secrets", "tokens")

    def __init__(self, tokens: Iterable[bytes], secrets: Iterable[bytes] = (),
                 own: Iterable[bytes] = ()) -> None:
        self.tokens = _minimal(tokens, ())
        self.secrets = _minimal(secrets, self.tokens)
        self.own = _minimal(own, self.tokens)
        longest = max((len(m) for m in (*self.tokens, *self.secrets, *self.own)), default=1)
        self.keep = longest * _EXPANSION
        self._automaton = _automaton(self.tokens, self.secrets)
        # Every marker is a run of the base64 alphabets (lowercase: canonical form) of
        # `SEGMENT` characters or more, as a token's always are: then data without such
        # a run holds none (`find`).
        self.marker_runs = all(len(m) >= SEGMENT and _RUN_BYTES.issuperset(m)
                         for m in (*self.tokens, *self.secrets, *self.own))

    def find(self, data: bytes, gate: Gate | None = None, allowance: Allowance | None = None,
             deeper: bool = True, run: bool = False) -> str | None:
        """`token`, `secret` or None for raw `data` (canonicalised here), a token
        winning; `unreadable` for a compressed run past its bound (below).

        A body with no escape canonical form undoes (`%`, `\\u00`, `\\/`) reads as
        itself lowercased, which keeps every byte in or out of the base64 alphabets:
        where every marker is such a run (`marker_runs`) and the body holds no run of `SEGMENT`
        of those characters, no marker is in it: it is neither lowercased nor searched
        (`_skipped`: one gate pass, `gate` detection's when the request has it, which
        takes the answer for the same body), against 6 M instructions a MiB.

        Data holding a NUL is read again with its NULs out: UTF-16 or UTF-32 text (read so
        by its charset, byte-order mark or a guess) holds every ASCII marker that way.

        Where `deeper`, base64 written in lines is read joined and a run that is a
        compressed file unpacked (`leak_readings.beyond`), bounded by `allowance` (the
        data's own size's where None): `unreadable` past it. `run`: a pass made already
        found a run in `data` (a stream's): no gate pass is made to find it again."""
        if not data:
            return None
        found = self._read(data, None if run else gate, allowance, deeper, run)
        if found is None and data.find(b"\x00") >= 0:
            found = self._read(data.translate(None, b"\x00"), None, allowance, deeper)  # (a
            # table pass: `replace` takes 17 ns a byte of NULs, 1 s for 60 MiB unpacked)
        return found

    def whole(self, data: bytes, gate: Gate | None = None) -> str | None:
        """`find` for a message read whole (a WebSocket message): its bytes, then the
        files it is or holds (a gzip file, a zip's entries anywhere: `zip_entries`),
        each read as data is, within the message's bound (`unreadable` past it,
        `excess` past its sandbox's). A request body's files are read by its request
        side as it comes (`pipeline/exchange_request.py`)."""
        found = self.find(data, gate)
        if found is not None or not data or not holds_files(data):
            return found
        allowance = Allowance(len(data))
        try:
            files = unpacked_files(data, allowance)
        except ExcessError:
            return "excess"
        except EncodingError:
            return "unreadable"
        return next((kind for _, file in files
                     if (kind := self.find(file, allowance=allowance)) is not None), None)

    def _read(self, data: bytes, gate: Gate | None, allowance: Allowance | None,
              deeper: bool, run: bool = False) -> str | None:
        if not run and self.marker_runs and len(data) >= _GATED and \
                _skipped(data, gate or _RUNS):
            return None
        kept = undone(data)
        text = kept.lower()
        if self._automaton is not None:
            found, starts, lined = self._automaton.kind(text)
            if found == "token":
                return found
        else:  # (no shared markers: the compressed files' starts looked for here)
            found, starts, lined = None, readings.archive_starts(text), True
        find = text.find  # (`find`, not `in`: see `leak_stream.plain`)
        for marker in self.own:
            if find(marker) >= 0:
                return "token"
        if found == "secret" or not deeper:
            return found
        blocks = readings.joined(kept) if lined or starts else None
        if not blocks and not starts:
            return None  # (most data: no lines of base64, no compressed file's start)
        return readings.beyond(kept, blocks or [], starts, allowance or Allowance(len(kept)),
                               lambda flat: self._read(flat, None, None, False),
                               lambda file: self.find(file, deeper=False))

    def head(self, method: str, target: str, fields: Iterable[tuple[bytes, bytes]]) -> str | None:
        """Scan a request head: line, fields, and every value joined (split values)."""
        fields = list(fields)
        parts = [method.encode("latin-1"), b" ", target.encode("utf-8", "surrogateescape"),
                 b"\n"]
        for name, value in fields:
            parts += [name, b": ", value, b"\n"]
        parts.append(b"".join(value for _, value in fields))
        return self.find(b"".join(parts))

    def stream(self, allowance: Allowance | None = None) -> StreamScan:
        """A scan of a stream of chunks with these markers (`leak_stream`)."""
        return StreamScan(self, allowance)


class _Markers:
    """Tokens and keys found in one pass over a text: Hyperscan's literal matcher (the
    DLP prefilter's, `core/dlp/fastscan.py`; an Aho-Corasick automaton was three quarters
    of a 1 MiB upload's CPU), or for a text under `SMALL` bytes (a head) the automaton,
    whose call costs less than setting up a Hyperscan scan."""

    __slots__ = ("_automaton", "_kinds", "_literals", "_tokens")
    SMALL = 2048

    def __init__(self, tokens: tuple[bytes, ...], secrets: tuple[bytes, ...]) -> None:
        self._tokens = frozenset(m.decode("latin-1") for m in tokens)
        self._kinds = {m.decode("latin-1"): "secret" for m in secrets}
        self._kinds.update((m, "token") for m in self._tokens)
        self._automaton: Any = ahocorasick.Automaton()
        for marker in self._kinds:
            self._automaton.add_word(marker, marker)
        self._automaton.make_automaton()
        for value in (*tokens, *secrets):  # (tiles: in the large texts' pass only)
            for at in range(0, len(value) - readings.TILE + 1, readings.TILE):
                self._kinds.setdefault(value[at:at + readings.TILE].decode("latin-1"), "lines")
        self._kinds.update((m.decode("latin-1"), "archive") for m in readings.ARCHIVE_MARKERS)
        self._literals = Literals(list(self._kinds))

    def kind(self, text: bytes) -> tuple[str | None, list[int], bool]:
        """`token` if a token's marker is in `text`, else `secret` if a key's is; where
        compressed files' encoded starts are (`leak_readings`); whether base64 lines may
        cut a marker (a tile of one is in `text`: every 16 characters of a marker hold
        a tile, `leak_readings.TILE`, and a marker cut by lines of 20 or more holds 16)."""
        found_at: Iterator[tuple[int, str]]
        starts: list[int] = []
        lined = len(text) < self.SMALL  # (a small text: its blocks looked for, `joined`)
        if lined:  # (no compressed file's start or tile in the automaton: short words
            starts += readings.archive_starts(text)  # make every step cost)
            found_at = ((end + 1 - len(m), m) for end, m in self._automaton.iter(
                text.decode("latin-1")))
        else:  # (no limit: never None)
            found_at = iter(self._literals.find(text) or ())
        found: str | None = None
        for at, marker in found_at:
            kind = self._kinds[marker]
            if kind == "token":
                return "token", starts, lined
            if kind == "archive":
                starts.append(at)
            elif kind == "lines":
                lined = True
            elif kind == "secret":
                found = kind
        return found, starts, lined


@functools.lru_cache(maxsize=128)
def _automaton(tokens: tuple[bytes, ...], secrets: tuple[bytes, ...]) -> _Markers | None:
    """One matcher finding every marker, a token's kind winning (None: no markers)."""
    if not tokens and not secrets:
        return None
    return _Markers(tokens, secrets)


def _minimal(markers: Iterable[bytes], found_first: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """`markers` without those that hold another marker (or one of `found_first`):
    text holding such a marker holds the shorter one too, which is found first. A key's
    base64 holds the base64 of its first bytes, a padded form its unpadded one: about
    half of all markers are such. Shortest first."""
    kept: list[bytes] = []
    for marker in sorted(set(markers), key=len):
        if not any(m in marker for m in found_first) and not any(m in marker for m in kept):
            kept.append(marker)
    return tuple(kept)


def _skipped(data: bytes, checker: Gate) -> bool:
    """Whether `data` holds no escape `canonical` undoes and no run (`find`): the C
    pass answers both; else the escapes' bytes are looked for first (memchr)."""
    if checker.native:
        flags = checker.flags(data, keep=True, escapes=True)
        return not flags & RUN and plain(data, flags)
    return plain(data) and not checker.flags(data, keep=True) & RUN


class _Secret:
    """What redacting one secret needs, computed once per secret (`_secret`): its
    variants longest first, their proper prefixes and first bytes, and the matchers
    that tell in one pass whether any variant is in a text."""

    __slots__ = ("automaton", "firsts", "literals", "longest", "prefixes", "variants", "wide")

    def __init__(self, variants: tuple[bytes, ...], pieces: tuple[str, ...] = ()) -> None:
        self.variants = tuple(sorted(set(variants), key=len, reverse=True))
        # Each piece as UTF-16 or UTF-32 text, with [REDACTED] in the same: an upstream
        # may echo a key in either (searched apart, where the data holds a NUL).
        self.wide = tuple((piece.encode(codec), REDACTED.decode().encode(codec))
                          for piece in pieces if len(piece) >= _WIDE_SHORTEST
                          for codec in _WIDE)
        every = (*self.variants, *(w for w, _ in self.wide))
        self.prefixes = frozenset(v[:n] for v in every for n in range(1, len(v)))
        self.firsts = tuple({v[:1] for v in every if v})
        self.longest = max((len(v) for v in every), default=0)
        self.literals: Literals | None = None
        self.automaton: Any = None
        if any(self.variants):
            self.literals = Literals([v.decode("latin-1") for v in self.variants if v])
            self.automaton = ahocorasick.Automaton()
            for v in self.variants:
                self.automaton.add_word(v.decode("latin-1"), None)
            self.automaton.make_automaton()

    def found(self, data: bytes) -> bool:
        """Whether a variant is in `data` (a short text by the automaton, a body by
        Hyperscan: `_Markers`; a wide form where `data` holds a NUL)."""
        if self.wide and data.find(b"\x00") >= 0 and any(w in data for w, _ in self.wide):
            return True
        if self.literals is None:
            return False
        if len(data) < _Markers.SMALL:
            return next(self.automaton.iter(data.decode("latin-1")), None) is not None
        return self.literals.any(data)


@functools.lru_cache(maxsize=256)
def _secret(variants: tuple[bytes, ...], pieces: tuple[str, ...] = ()) -> _Secret:
    return _Secret(variants, pieces)


class Redactor:
    """A response-stream filter replacing a secret (all `variants`, and its `pieces` as
    UTF-16 and UTF-32 text) by [REDACTED]."""

    def __init__(self, variants: Iterable[bytes], pieces: Iterable[str] = ()) -> None:
        self._secret = _secret(tuple(variants), tuple(pieces))
        self.variants = self._secret.variants
        self._held = b""
        self.redactions = 0

    def found_in(self, pieces: Iterable[bytes]) -> bool:
        """Whether any variant is in any of `pieces` (one scan over them all)."""
        return self._secret.found(b"\n".join(pieces))  # (no variant holds a newline)

    def redact(self, data: bytes) -> bytes:
        """Replace every occurrence in a complete byte string."""
        if not self._secret.found(data):
            return data
        for v in self.variants:
            if v in data:
                self.redactions += data.count(v)
                data = data.replace(v, REDACTED)
        for wide, redacted in self._secret.wide:
            if wide in data:
                self.redactions += data.count(wide)
                data = data.replace(wide, redacted)
        return data

    def feed(self, chunk: bytes) -> bytes:
        """Filter one streamed chunk; a tail that could start a secret is held back."""
        data = self.redact(self._held + chunk)
        keep = self._partial_tail(data)
        self._held = data[len(data) - keep:] if keep else b""
        return data[: len(data) - keep]

    def end(self) -> bytes:
        """Release what was held back (end of the stream)."""
        held, self._held = self._held, b""
        return self.redact(held)

    def _partial_tail(self, data: bytes) -> int:
        """Length of the longest tail of `data` that is a proper prefix of a variant
        (tried only where a variant's first byte is)."""
        secret = self._secret
        start = max(0, len(data) - secret.longest + 1)
        best = len(data)
        for first in secret.firsts:
            at = data.find(first, start)
            while at != -1 and at < best:
                if data[at:] in secret.prefixes:
                    best = at
                    break
                at = data.find(first, at + 1)
        return len(data) - best
