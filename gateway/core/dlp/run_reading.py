"""The base64 and hex runs of a text a detector may find something in, decoded (pure).

A run is read where a receiver decodes it: a stretch of the alphabet (`decoding.runs_at`)
and a block of them written in lines (`wrapped`: `base64`, `openssl`, PEM and MIME wrap
at 64 or 76 characters, and Go's, Python's, Node's and Ruby's decoders skip the line
breaks; a break JSON-escaped, `\\n`, is one too: a JSON text inside a string, a tool
call's arguments, or a streamed JSON body's window, is read as it is sent). Most runs
decode to a few random bytes, which one C call says (`Gate.runs_clean`); a stretch that
gave nothing is remembered (`clean`: an agent resends its tool call ids every turn). A
run that decodes to a compressed file or an archive is always read on: the scanner
unpacks it (`archive_views.run_views`). A streamed window is cut where no run is read
in two pieces it cannot be read from (`stream_cut`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

from gateway.core.dlp.decoding import (
    MAX_SHIFTED,
    Run,
    decode_run,
    has_run,
    padded_end,
    runs,
    runs_at,
    stretches,
)
from gateway.core.dlp.fastscan import MAP, SEGMENT, as_bytes
from gateway.core.dlp.lines import line_start, stretches_and_blocks, wrapped
from gateway.core.dlp.prefilter import Prefilter, holds_json_escape
from gateway.core.zip_entries import holds_files

__all__ = ["CLEAN_RUN", "CLEAN_RUNS", "MIN_DECODED", "RunReader", "near_cut", "stream_cut"]

MIN_DECODED = 12  # decoded runs shorter than this hold no key
CLEAN_RUNS = 1024  # stretches remembered as decoding to nothing (`decoded`), at most
CLEAN_RUN = 256  # characters: a longer stretch is decoded again each time
_BREAKS = re.compile(r"\\r\\n|\\n|\r?\n")  # (a block's line breaks, `wrapped`)
_NOT_RUN = re.compile(r"\\[rn]|[^A-Za-z0-9+/_-]")  # (a block's breaks, as sent or escaped)


class RunReader:
    """The decoded runs of texts, for one prefilter (a scanner's)."""

    __slots__ = ("clean", "prefilter")

    def __init__(self, prefilter: Prefilter) -> None:
        self.prefilter = prefilter
        self.clean: set[str] = set()  # (stretches whose runs decode to nothing, bounded)

    def decoded(self, text: str, joins: Sequence[int] = ()) -> Iterator[tuple[Run, str]]:
        """The runs of `text` whose decoded text a detector may find something in (an
        anchor, a run to decode again, a compressed file), with that text. A block of
        lines is one run from its first line to its last (`Run`'s bounds in `text`);
        `joins`: where the views joined in `text` start (`decoding.wrapped`)."""
        # (lines: a block; its breaks as sent or JSON-escaped, as a JSON text in a
        # string is: the blocks found with the stretches, one C call)
        listed, blocks = stretches_and_blocks(text, joins)
        clean = self.clean
        for start, end in listed:
            # (what `runs_at` reads: the stretch and its padding, nothing around them)
            stretch = text[start:padded_end(text, end)]
            if stretch not in clean:  # (most: an id seen before, decoding to nothing)
                yield from self._stretch(text, start, end, stretch)
        for lo, hi in blocks:
            flat = _BREAKS.sub("", text[lo:hi])
            # (from each of its first 4 characters: a short first line, not read as the
            # block's, puts its alignment anywhere; `runs_at` does it up to 1 KiB)
            for shift in range(4 if len(flat) > MAX_SHIFTED else 1):
                part = flat[shift:]
                for run, inner in self._stretch(part, 0, len(part), part):
                    yield Run(lo, hi, run.kind), inner

    def _stretch(self, text: str, start: int, end: int, stretch: str
                 ) -> Iterator[tuple[Run, str]]:
        """The runs of one stretch, text[start:end], that `decoded` yields."""
        clean, gated = self.clean, not self.prefilter.unanchored  # (else: look)
        if stretch in clean:
            return
        holds = False  # (most runs decode to a few random bytes: one C call says so)
        for run in () if gated and self.prefilter.gate.runs_clean(
                stretch.encode("latin-1", "replace")) else runs_at(text, start, end):
            found = self.inner(text, run)
            if found is not None:
                holds = True
                yield found
        if not holds and len(stretch) <= CLEAN_RUN:
            if len(clean) >= CLEAN_RUNS:
                clean.clear()
            clean.add(stretch)

    def inner(self, text: str, run: Run) -> tuple[Run, str] | None:
        """`run` and its decoded text where a detector may find something in it."""
        data = decode_run(text, run)
        if data is None or len(data) < MIN_DECODED:
            return None
        if holds_files(data):  # (a compressed file, or a zip's entries anywhere in it:
            return run, data.decode("latin-1")  # unpacked by the scanner)
        if len(data) < SEGMENT:  # (no run: only the gate's anchors count, asked in C)
            return (run, data.decode("latin-1")) if self.prefilter.candidate(data) else None
        inner = data.decode("latin-1")
        return (run, inner) if self.prefilter.any(inner) or has_run(inner) or \
            holds_json_escape(inner) else None


def near_cut(text: str, cut: int) -> bool:
    """Whether a run may cross `cut` (the cheap check before `runs` over the window): a
    run crossing it lies in `SEGMENT` or more base64 characters in a row holding
    character cut-1 or cut-2 (a run's end takes up to two "=" of padding), so within
    text[cut-2-SEGMENT:cut+SEGMENT]."""
    near = as_bytes(text[max(0, cut - 2 - SEGMENT):cut + SEGMENT]).translate(MAP)
    return b"a" * SEGMENT in near


def stream_cut(text: str, cut: int) -> int:
    """Where a streamed window's `text` is cut, near `cut`, so that a run crossing it is
    read whole by the next window: at a multiple of 4 of its characters from its start (a
    block's line breaks, as sent or JSON-escaped, not counted), so the next window
    decodes it at its own alignment. (A compressed file's run crossing it is followed
    as it streams: `streamed_runs.open_run`.)"""
    listed = list(stretches(text))
    for lo, hi in wrapped(text, listed, escaped=True) if text.find("n") >= 0 else ():
        if lo < cut < hi:
            start = line_start(text, lo, cut, True)
            while (at := start + -len(_NOT_RUN.sub("", text[lo:start])) % 4) > cut:
                start = line_start(text, lo, start - 2, True)  # (the line before)
            return at
        if lo >= cut:
            break
    for run in runs(text):
        if run.start < cut < run.end:
            return run.start + (cut - run.start) // 4 * 4
        if run.start >= cut:
            break
    return cut
