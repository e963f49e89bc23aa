"""The C-speed passes (`fastscan`): the gate's pass in C (`_gate.c`, where built), Hyperscan
and the fallback (pyahocorasick, translate) give the same answers as a plain search, on
prose, binary bytes, text past latin-1 and every default anchor planted at the edges and
overlapping; scans from several threads at once each get their own scratch space."""

from __future__ import annotations

import random

import pytest
from helpers.threads import at_once

from gateway.core.dlp import DEFAULT, fastscan
from gateway.core.dlp.fastscan import (
    HYPERSCAN,
    NATIVE,
    RUN,
    SEGMENT,
    ChunkPass,
    Gate,
    Literals,
    has_segment,
)
from gateway.core.dlp.prefilter import Prefilter
from gateway.services.dlp.library import build

ANCHORS = sorted({a for d in build(DEFAULT) for r in d.rules for a in r.anchors})
MODES = [pytest.param(True, marks=pytest.mark.skipif(not HYPERSCAN, reason="no hyperscan")),
         False]
# The gate's pass: in C, on Hyperscan, or the fallback.
ENGINES = [pytest.param("native", marks=pytest.mark.skipif(not NATIVE, reason="not built")),
           pytest.param("hyperscan", marks=pytest.mark.skipif(not HYPERSCAN,
                                                              reason="no hyperscan")),
           "python"]


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """The gate's pass under test; returns `fast` (the C pass is on only for "native")."""
    monkeypatch.setattr(fastscan, "NATIVE", request.param == "native")
    return bool(request.param != "python")


def _every(text: str) -> set[tuple[int, str]]:
    """Every anchor occurrence, by a plain search."""
    out = set()
    for anchor in ANCHORS:
        at = text.find(anchor)
        while at != -1:
            out.add((at, anchor))
            at = text.find(anchor, at + 1)
    return out


def _texts() -> list[str]:
    r = random.Random(43)
    words = ["the", "request", "model", "ACCEPT", "SKIP", "hf", "sk", "eyJ", "://", "AC"]
    prose = " ".join(r.choice(words) for _ in range(20_000))
    binary = r.randbytes(100_000).decode("latin-1")
    planted = "".join(a + r.choice(["", " ", "x"]) for a in ANCHORS * 3)
    return [prose, binary, planted, ANCHORS[0] + binary[:500] + ANCHORS[-1],
            "\u20ac\u4e2d" + planted + "\U0001f600" + prose[:2000],  # past latin-1
            "sk-ant-sk-proj-SKACAKIAABIA://eyJhf_SG.-us",  # anchors overlapping
            "", "A"]


@pytest.mark.parametrize("fast", MODES)
def test_every_anchor_is_found_where_it_is(fast: bool) -> None:
    literals = Literals(ANCHORS, fast=fast)
    for text in _texts():
        found = literals.find(text)
        assert set(found) == _every(text), text[:40]
        assert len(found) == len(set(found))
        assert literals.any(text) == bool(found)


@pytest.mark.parametrize(("text", "holds"), [
    ("a" * (SEGMENT - 1), False),
    ("a" * SEGMENT, True),
    (" x " + "Ab+/_-09" * 3 + " y", True),
    ("word " * 1000, False),
    ("abcdefghij" + "\u20ac" + "klmnopqrstu", False),  # a character past latin-1 cuts it
    ("abcdefghij" + "=" + "klmnopqrstu", False),
    ("x" * 5000 + " " + "Q" * SEGMENT, True),
    ("", False),
])
def test_a_segment_is_twenty_base64_characters_in_a_row(engine: bool, text: str,
                                                        holds: bool) -> None:
    assert has_segment(text, fast=engine) is holds


@pytest.mark.skipif(not HYPERSCAN, reason="no hyperscan")
def test_both_modes_agree_on_random_texts() -> None:
    r = random.Random(7)
    alphabet = "aB0+/_- \n=.\u00e9"
    for _ in range(300):
        text = "".join(r.choice(alphabet) if r.random() < 0.2 else r.choice("aB0")
                       for _ in range(r.randint(0, 120)))
        assert has_segment(text, fast=True) == has_segment(text, fast=False), text


@pytest.mark.skipif(not HYPERSCAN, reason="no hyperscan")
def test_scans_from_several_threads_at_once() -> None:
    """A Hyperscan scan releases the GIL and a scratch space serves one scan at a time:
    each scan takes its own from the pool."""
    literals = Literals(ANCHORS)
    text = ("the request " * 50_000) + "ghp_" + ("model " * 50_000)
    want = _every(text)

    def work() -> None:
        for _ in range(20):
            assert set(literals.find(text)) == want
            assert not has_segment(text[:400_000])

    at_once(work)


# -- the pass over a stream, a chunk at a time (ChunkPass) --------------------------------

_RUN_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/_-")


def _ends(data: bytes, gate: Gate) -> tuple[list[bool], list[bool]]:
    """Per byte, by plain searches: whether a run of SEGMENT ends there, and whether one
    of the gate's literals (any case, where caseless) does."""
    runs, literals = [False] * len(data), [False] * len(data)
    row = 0
    for i, byte in enumerate(data):
        row = row + 1 if byte in _RUN_CHARS else 0
        runs[i] = row >= SEGMENT
    lowered = data.lower()
    for word, caseless in gate.literals:
        needle, text = (word.lower(), lowered) if caseless else (word, data)
        at = text.find(needle.encode())
        while at != -1:
            literals[at + len(needle) - 1] = True
            at = text.find(needle.encode(), at + 1)
    return runs, literals


def test_a_chunk_pass_flags_each_chunk_a_run_or_literal_ends_in(engine: bool) -> None:
    """Prose with one to three planted literals (a caseless one in mixed case) or runs
    of 19 to 23, cut at random (pieces of 1 byte to 20 KB, shorter and longer than the seam
    is scanned apart) and once inside each planted one: a chunk in which a run ends has
    RUN, one in which a literal ends a flag; and a flag is set only if one ends in the
    chunk or in the `overlap` bytes before it."""
    gate = Prefilter(build(DEFAULT), fast=engine).gate
    r = random.Random(43)
    words = ["the", "request", "model", "=", "{", "\n"]
    for _ in range(150):
        text, planted = "", []
        for _ in range(r.randint(1, 3)):
            if r.random() < 0.5:
                word, caseless = r.choice(gate.literals)
                item = "".join(c.swapcase() if caseless and r.random() < 0.5 else c
                               for c in word)
            else:
                item = "".join(r.choice("aZ09+/_-") for _ in range(r.randint(19, 23)))
            text += " ".join(r.choice(words) for _ in range(r.randint(1, 3000))) + " "
            planted.append((len(text), len(item)))
            text += item + " "
        data = (text + " ".join(r.choice(words) for _ in range(r.randint(1, 3000)))).encode()
        runs, literals = _ends(data, gate)
        cuts = {at + r.randrange(1, size) for at, size in planted}
        at = 0
        while at < len(data):
            at += r.choice([r.randint(1, 40), r.randint(3_500, 4_500), r.randint(5_000, 20_000)])
            cuts.add(at)
        chunks = ChunkPass(gate)
        for lo, hi in zip([0, *sorted(cuts)], sorted(cuts), strict=False):
            flags = chunks.flags(data[lo:hi])
            hi = min(hi, len(data))
            if any(runs[lo:hi]):
                assert flags & RUN, (lo, hi)
            if any(literals[lo:hi]):
                assert flags, (lo, hi)
            before = max(0, lo - chunks.overlap)
            if flags & RUN:
                assert any(runs[before:hi]), (lo, hi)
            if flags:
                assert any(runs[before:hi]) or any(literals[before:hi]), (lo, hi)


def test_the_overlap_is_the_longest_literal_or_run_less_one() -> None:
    gate = Prefilter(build(DEFAULT)).gate
    longest = max(len(w) for w, _ in gate.literals)
    assert longest > SEGMENT  # (a PEM header: the literals set the overlap)
    assert ChunkPass(gate).overlap == longest - 1
    assert ChunkPass(Gate()).overlap == SEGMENT - 1


@pytest.mark.parametrize("size", [100, 10_000])  # (the seam with the chunk, or apart)
def test_a_literal_or_run_cut_anywhere_is_flagged_where_it_ends(engine: bool,
                                                               size: int) -> None:
    """Each of the gate's literals and a run of SEGMENT, cut at each offset: the chunk
    it ends in is flagged (the longest literal sets how far back the pass looks)."""
    gate = Prefilter(build(DEFAULT), fast=engine).gate
    prose = b"the model " * 1_000
    assert not ChunkPass(gate).flags(prose)
    for item in [w.encode() for w, _ in gate.literals] + [b"Ab0+/_-9" * 2 + b"Zz-_"]:
        for cut in range(1, len(item)):
            chunks = ChunkPass(gate)
            chunks.flags(prose + item[:cut])
            flags = chunks.flags(item[cut:] + prose[:size])
            assert flags & RUN if len(item) == SEGMENT and b" " not in item else flags, \
                (item, cut)


def test_the_c_pass_is_built_where_it_can_be() -> None:
    """Where gcc is and the CPU has AVX2 (x86-64 Linux, like CI's machine), `pip install`
    built `_gate.c` and it imports: the C pass's tests then run instead of skipping (a
    build error is silent in an optional extension)."""
    import platform
    import shutil
    from pathlib import Path
    cpu = Path("/proc/cpuinfo")
    if platform.machine() != "x86_64" or shutil.which("gcc") is None or \
            not cpu.is_file() or " avx2" not in cpu.read_text():
        pytest.skip("no gcc, or not x86-64 with AVX2")
    assert NATIVE
