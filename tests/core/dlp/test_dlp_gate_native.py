"""The gate's pass in C (gateway/core/dlp/_gate.c): the same answers as a plain reading of
the bytes, on texts of every length around its 64-byte blocks with runs and literals
planted across their edges, and the same as Hyperscan's gate on prose and binary bytes;
a literal it does not take leaves the gate on Hyperscan."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from helpers.sanitized import run_sanitized
from helpers.threads import at_once

from gateway.core.dlp import DEFAULT
from gateway.core.dlp.fastscan import (
    _ALPHABET,
    BACKSLASH,
    ESCAPES_KNOWN,
    HYPERSCAN,
    LITERAL,
    NATIVE,
    PERCENT,
    PLUS,
    RUN,
    SEGMENT,
    UNDECIDED,
    Gate,
)
from gateway.core.dlp.prefilter import Prefilter
from gateway.services.dlp.library import build

pytestmark = pytest.mark.skipif(not NATIVE, reason="_gate.c not built, or no AVX2")

if NATIVE:
    import gateway.core.dlp._gate as _gate  # type: ignore[import-not-found]
# The pass's widths: 32 bytes a vector (AVX2), and 64 (AVX-512 BW) where the CPU has it.
WIDTHS = [False, pytest.param(True, marks=pytest.mark.skipif(
    not NATIVE or not _gate.AVX512, reason="no AVX-512 BW"))]

DEFAULT_LITERALS = Prefilter(build(DEFAULT)).gate.literals
OTHER_LITERALS = (("abc", False), ("ABD", True), ("x" * 255, False), ("://", False),
                  ("-----BEGIN", False), ("zz_", True))
# More than eight pairs (buckets by a pair's first byte, then in turn), several looked
# for by their second and third bytes (`eyJ` by `yJ`), caseless ones among them.
MANY_PAIRS = (("eyJ", False), ("sq0csp-", False), ("qZ1x", False), ("a9Q", True),
              ("hello", False), ("xyz", True), ("Ab_", False), ("_Zk", False),
              ("k:/", False), ("==Q", False), ("Mq-", False), ("eyZ", True), ("AK9", False))


def plain(data: bytes, literals: tuple[tuple[str, bool], ...]) -> tuple[bool, bool]:
    """(a run of SEGMENT, a literal) by reading the bytes one by one."""
    row = 0
    run = False
    for byte in data:
        row = row + 1 if byte in _ALPHABET else 0
        if row >= SEGMENT:
            run = True
            break
    lowered = data.lower()
    literal = any((w.lower().encode() in lowered) if caseless else (w.encode() in data)
                  for w, caseless in literals)
    return run, literal


def agrees(flags: int, expected: tuple[bool, bool]) -> bool:
    """RUN exactly; LITERAL exactly where there is no run (a run decides both askers)."""
    run, literal = expected
    return bool(flags & RUN) == run and (run or bool(flags & LITERAL) == literal)


def escapes_agree(flags: int, data: bytes) -> bool:
    """Where no run was found: ESCAPES_KNOWN, and each escape's bit exactly."""
    if flags & RUN:
        return True
    return bool(flags & ESCAPES_KNOWN) and all(
        bool(flags & bit) == (byte in data)
        for bit, byte in ((PERCENT, b"%"), (BACKSLASH, b"\\"), (PLUS, b"+")))


def texts(seed: int, literals: tuple[tuple[str, bool], ...], count: int) -> list[bytes]:
    """Texts of 0 to 400 bytes (mostly about the blocks' edges) of bytes near the
    alphabet's and the literals', with runs of SEGMENT - 1 and SEGMENT and literals (in
    mixed case where caseless) planted at the edges."""
    r = random.Random(seed)
    pool = b" \n.,:/{}\"'=-_+%\\azAZ09\x00\x7f\x80\xff" + \
        bytes({b for w, _ in literals for b in w.encode()[:3]})
    edges = [0, 1, 2, 19, 20, 21, 44, 45, 46, 62, 63, 64, 65, 66, 67, 126, 127, 128, 129,
             130, 191, 192, 193]
    out = []
    for _ in range(count):
        n = r.choice([*edges, r.randrange(400)])
        data = bytearray(r.choice(pool) for _ in range(n)) if r.random() < 0.7 \
            else bytearray(b" " * n)
        for _ in range(r.randrange(3)):
            if not n:
                break
            kind = r.choice(["run", "short", "literal"])
            if kind == "literal":
                word, caseless = r.choice(literals)
                piece = bytes(c ^ 0x20 if caseless and chr(c).isalpha() and r.random() < 0.5
                              else c for c in word.encode())
            else:
                size = SEGMENT if kind == "run" else SEGMENT - 1
                piece = bytes(r.choice(_ALPHABET) for _ in range(size))
            at = r.choice([*[e for e in edges if e < n], max(0, n - len(piece)),
                           r.randrange(n)])
            data[at:at + len(piece)] = piece
        out.append(bytes(data))
    return out


@pytest.mark.parametrize("wide", WIDTHS, ids=["avx2", "avx512"])
@pytest.mark.parametrize("literals", [DEFAULT_LITERALS, OTHER_LITERALS, MANY_PAIRS, ()],
                         ids=["default detectors", "others", "many pairs", "the run alone"])
def test_the_c_pass_reads_what_a_plain_reading_reads(
        literals: tuple[tuple[str, bool], ...], wide: bool) -> None:
    gate = _gate.Gate(_ALPHABET, SEGMENT, [(w.encode(), c) for w, c in literals], wide=wide)
    wrong = [t for t in texts(41, literals or (("abc", False),), 20_000)
             if not agrees(gate.flags(t), plain(t, literals))
             or not escapes_agree(gate.flags(t), t)]
    assert not wrong, wrong[:3]


@pytest.mark.parametrize("wide", WIDTHS, ids=["avx2", "avx512"])
def test_the_seam_from_before_is_read_in_the_same_call(wide: bool) -> None:
    """`flags(text, before)`: what `flags(text)` finds, and a run or literal crossing
    from `before` into the text (read with the text's first bytes), as two passes find
    them; `before` longer than 255 bytes is refused."""
    gate = _gate.Gate(_ALPHABET, SEGMENT, [(w.encode(), c) for w, c in DEFAULT_LITERALS],
                      wide=wide)
    pieces = texts(47, DEFAULT_LITERALS, 6_000)
    r = random.Random(47)
    for text in pieces:
        before = r.choice(pieces)[-r.randrange(1, 40):]
        both = gate.flags(text)
        if before and not both & RUN:
            both |= gate.flags(before + text[:len(before)]) & (RUN | LITERAL)
        assert gate.flags(text, before) & (RUN | LITERAL) == both & (RUN | LITERAL), \
            (before, text)
    # `eyJ` is looked for by its pair `yJ`: the literal begins a byte before the pair,
    # in `before` or not at all
    assert gate.flags(b"yJ and more", b"the e") & LITERAL
    assert not gate.flags(b"yJ and more", b"the ") & LITERAL
    assert not gate.flags(b"yJ and more") & LITERAL and gate.flags(b"eyJ") & LITERAL
    with pytest.raises(ValueError, match="255"):
        gate.flags(b"x", b"y" * 256)


@pytest.mark.skipif(not HYPERSCAN, reason="no hyperscan")
def test_the_c_pass_answers_as_hyperscans_gate() -> None:
    native, hyperscan = Gate(DEFAULT_LITERALS), Gate(DEFAULT_LITERALS, native=False)
    r = random.Random(43)
    words = [b"the", b"model", b"eyJ", b"://", b"AKC", b"APF", b"xOx", b"BEGIN", b"\n",
             b"Ab0+/_-9" * 2, b"\xff\x00"]
    samples = [b" ".join(r.choice(words) for _ in range(r.randrange(1, 400)))
               for _ in range(2_000)] + [r.randbytes(r.randrange(1, 5_000)) for _ in range(300)]
    for sample in samples:
        expected = hyperscan.flags(sample)
        assert agrees(native.flags(sample), (bool(expected & RUN), bool(expected & LITERAL)))


def test_long_texts_buffers_and_threads() -> None:
    """A text over 64 KiB (scanned with the GIL released) from four threads at once, as
    bytes, bytearray and memoryview; the run or literal at its very end."""
    gate = Gate(DEFAULT_LITERALS)
    body = b"the model said nothing " * 20_000
    cases = [(body, 0), (body + b"eyJ", LITERAL), (body + b"a" * SEGMENT, RUN),
             (b"A" * SEGMENT + body, RUN)]

    def work() -> None:
        for _ in range(10):
            for text, flags in cases:
                for view in (text, bytearray(text), memoryview(text)):
                    assert gate.flags(view) & flags == flags
                    assert flags or not gate.flags(view)

    at_once(work)


@pytest.mark.parametrize(("literals", "why"), [
    ([(b"ab", False)], "3 to 255 bytes"),
    ([(b"abc", False)] * 65, "more than 64"),
    ([(b"x" * 256, False)], "3 to 255 bytes"),
])
def test_literals_it_does_not_take_leave_the_gate_on_hyperscan(
        literals: list[tuple[bytes, bool]], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        _gate.Gate(_ALPHABET, SEGMENT, literals)
    words = tuple((w.decode(), c) for w, c in literals)
    gate = Gate(words)
    assert gate._native is None
    for text in (b"xx ab abc yy", b"no such words"):
        assert agrees(gate.flags(text), plain(text, words)), text


def test_the_default_gate_takes_the_c_pass() -> None:
    assert Prefilter(build(DEFAULT)).gate._native is not None
    assert Gate()._native is not None


_ASAN_RUN = """
import importlib.util, random, sys
spec = importlib.util.spec_from_file_location("_gate", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
literals = [(w.encode(), c) for w, c in %r]
gates = [module.Gate(%r, %d, literals, wide=wide)
         for wide in (False, True)[:1 + module.AVX512]]
r = random.Random(5)
for pool in (b"ab :/AKCxoX-09\\x00\\xff", b"0123456789abcdefABCDEF-=_+/"):
    table = bytes(pool[i %% len(pool)] for i in range(256))
    for n in [*range(300), *(r.randrange(100_000) for _ in range(30))]:
        for _ in range(10):
            data = r.randbytes(n).translate(table)
            for gate in gates:
                gate.flags(data)
                gate.flags(bytearray(data))
                gate.flags(data, data[-31:])
                gate.runs_clean(data)
            module.key_run(data)
            module.key_run(bytearray(data))
            for width in (1, 32, 64)[:2 + module.AVX512]:
                module.local_header(data, r.randrange(n + 2), width)
                module.local_header(bytearray(data.replace(b"a", b"PK\\x03\\x04"[:1 + n %% 4])),
                                    0, width)
print("clean")
"""


def test_no_read_past_a_buffer_under_address_sanitizer(tmp_path: Path) -> None:
    """The C pass (and `key_run`) built with AddressSanitizer and UBSan (both widths where
    the CPU has AVX-512) reads texts of every length up to 300 bytes (and longer ones) in buffers of
    exactly their size (PYTHONMALLOC=malloc: each its own allocation, a red zone after
    it): no byte past a text is read."""
    source = Path(_gate.__file__).parents[0] / "_gate.c"
    script = _ASAN_RUN % (DEFAULT_LITERALS, _ALPHABET, SEGMENT)
    assert run_sanitized(source, tmp_path, script, timeout=120).strip() == "clean"


@pytest.mark.parametrize("width", [1, 32, 64])
def test_local_header_finds_what_bytes_find_finds(width: int) -> None:
    """`local_header` (a zip entry's `PK\\3\\4`, `core/zip_entries.py`) at every offset
    and length around its steps (64 and 128 bytes; 1: the scalar loop), with partial
    signatures about, from every start: the offset `bytes.find` gives."""
    if width == 64 and not _gate.AVX512:
        pytest.skip("no AVX-512 BW")
    rng = random.Random(9)
    for n in [*range(300), *(rng.randrange(10_000) for _ in range(40))]:
        for _ in range(6):
            data = bytearray(rng.choice(b"PK\x03\x04x") for _ in range(n))
            if n >= 4 and rng.random() < 0.7:
                at = rng.randrange(n - 3)
                data[at:at + 4] = b"PK\x03\x04"
            text = bytes(data)
            for start in {0, 1, n // 2, max(n - 4, 0), n, n + 3, -2}:
                assert _gate.local_header(text, start, width) == text.find(
                    b"PK\x03\x04", max(start, 0))
            assert _gate.local_header(data, 0, width) == text.find(b"PK\x03\x04")


CRAFTED = {  # texts that keep the prefilter busy without holding a literal or a run
    "nibble cross products": b"APG " * 40_000,
    "a literal's prefix, over and over": b"BEGIN PRIVATE KE " * 10_000,
    "cross products, mixed": b"APG xOy APH :/x API " * 10_000,
}


@pytest.mark.parametrize("wide", WIDTHS, ids=["avx2", "avx512"])
@pytest.mark.parametrize("text", list(CRAFTED.values()), ids=list(CRAFTED))
def test_a_text_that_keeps_the_prefilter_busy_goes_to_hyperscan(wide: bool,
                                                                text: bytes) -> None:
    """A hostile body can make every fourth position a candidate (a cross product of the
    literals' nibbles) or a literal's prefix that needs comparing: the C pass gives up
    after a bounded amount of that work (UNDECIDED) instead of costing 60 times its
    usual time, and the gate answers from Hyperscan; a literal in such a text is still
    found, and the same text with a literal far in is decided like a plain reading."""
    raw = _gate.Gate(_ALPHABET, SEGMENT, [(w.encode(), c) for w, c in DEFAULT_LITERALS],
                     wide=wide)
    assert raw.flags(text) & UNDECIDED
    assert not raw.flags(text[:2_000]) & UNDECIDED  # (within the free work)
    gate = Gate(DEFAULT_LITERALS)
    for sample in (text, text + b" eyJ", b"eyJ " + text, text + b" " + b"a" * SEGMENT):
        assert agrees(gate.flags(sample), plain(sample, DEFAULT_LITERALS)), sample[-30:]


def _key_texts(seed: int, count: int) -> list[str]:
    """Texts of runs a decoder may or may not read: one-case words and paths, mixed
    case, hex of one case and of both, digits, around the lengths that decide (19-21,
    31-33, 1,024-1,026), beside separators and characters out of latin-1."""
    r = random.Random(seed)
    lower, upper = "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    kinds = [lower + "_-/", upper + "_+", lower + upper, "0123456789abcdef",
             "0123456789ABCDEF", "0123456789", "0123456789abcdefABCDEF", lower + "0123456789"]
    out = []
    for _ in range(count):
        pieces = []
        for _ in range(r.randrange(1, 5)):
            size = r.choice([1, 5, 19, 20, 21, 31, 32, 33, 40, 1023, 1024, 1025, 1026,
                             r.randrange(60)])
            kind = r.choice(kinds)
            pieces.append("".join(r.choice(kind) for _ in range(size)))
            pieces.append(r.choice([" ", ".", "\n", "=", "\u2014", "\xff", ""]))
        out.append("".join(pieces))
    return out


def test_key_run_says_no_only_where_runs_reads_nothing() -> None:
    """`key_run` (C) against `decoding.runs` (the Python reading it stands before):
    equal, but where a mixed-case run longer than 1,024 characters has no decodable
    alignment (`runs` then yields nothing: True is only a "look")."""
    from gateway.core.dlp.decoding import runs
    from gateway.core.dlp.fastscan import as_bytes, key_run

    for text in _key_texts(11, 6_000):
        found = next(runs(text), None) is not None
        said = key_run(text)
        assert said == _gate.key_run(as_bytes(text)) == _gate.key_run(
            bytearray(as_bytes(text)))
        if found:
            assert said, text
        elif said:
            longest = max(len(w) for w in text.encode("latin-1", "replace").translate(
                bytes(0x61 if bytes([i]) in _ALPHABET else 0x20 for i in range(256))).split())
            assert longest > 1024, text
    assert not key_run("x" * 10_000) and key_run("x" * 5_000 + "Y" * 20)


def _run_texts(seed: int, count: int) -> list[str]:
    """Texts whose runs decode to a few bytes or more: W3C trace ids, tool call ids,
    base64 and hex of random bytes and of the fakes (whole, cut, behind a character or
    two), hex of one case and of both, with and without padding, among words."""
    import base64

    from helpers.dlp_corpus import DEFAULT_CORPUS

    r = random.Random(seed)
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    out = []
    for _ in range(count):
        pieces = []
        for _ in range(r.randrange(1, 4)):
            kind = r.randrange(7)
            data = r.randbytes(r.randrange(8, 40)) if r.random() < 0.7 else \
                r.choice(DEFAULT_CORPUS).text.encode()[:r.randrange(10, 60)]
            if kind == 0:
                pieces.append(f"00-{r.randbytes(16).hex()}-{r.randbytes(8).hex()}-01")
            elif kind == 1:
                pieces.append("call_" + "".join(r.choice(letters) for _ in range(24)))
            elif kind == 2:
                pieces.append(base64.b64encode(data).decode())
            elif kind == 3:
                pieces.append(base64.urlsafe_b64encode(data).decode().rstrip("="))
            elif kind == 4:
                pieces.append(r.choice([data.hex(), data.hex().upper()]))
            elif kind == 5:
                pieces.append(r.choice("xk_Q") + base64.b64encode(data).decode()[
                    r.randrange(3):])
            else:
                pieces.append(data.hex()[:r.randrange(30, 70)] + r.choice(["g", "-", "Z"])
                              + data.hex().upper())
            pieces.append(r.choice([" ", "\n", "/", ".", "=", "==", ""]))
        out.append("".join(pieces))
    return out


def _finds(scanner: Any, text: str, run: Any) -> bool:
    """Whether the scan of a run's decoded text (as `Scanner.parts_hits` reads it, one
    level down) finds anything."""
    from gateway.core.dlp import Location

    inner = scanner.runs.inner(text, run)
    return inner is not None and next(scanner.text_hits(inner[1], Location("body"), 1),
                                      None) is not None


def test_runs_clean_says_clean_only_where_no_run_decodes_to_anything_to_read() -> None:
    """`Gate.runs_clean` (C) against the Python reading it stands before (every run of
    `decoding.runs`, decoded and judged by `Scanner._inner`, then scanned): True exactly
    where the Python reading keeps no run, for texts whose runs all decode to fewer than
    20 bytes; for longer decodings, True only where the scan of every run's decoded text
    finds nothing (the gate's run and literals: what a detector needs there), False
    (look) where the gate finds something in one."""
    import base64

    from gateway.core.dlp import Scanner
    from gateway.core.dlp.decoding import decode_run, runs

    scanner = Scanner(build(DEFAULT), b"salt")
    gate = scanner.prefilter.gate
    assert gate.native
    texts = [*_run_texts(17, 4000),
             # decoding to bytes that hold a gate literal (a rule that needs no run)
             base64.b64encode(b"x://a:bc@host.x").decode(), b"xy://ab:cd@e.fg".hex(),
             base64.b64encode(b"-----BEGIN RSA").decode(), "aGVsbG8gd29ybGQgaGk=",
             # longer: an anchor of a rule that needs a run, without one; a run
             base64.b64encode(b"\x00ghp_\x01" * 4).decode(),
             base64.b64encode(b"\x01" + b"A1b2" * 6).decode()]
    agreed = long_clean = looked = 0
    for text in texts:
        every = list(runs(text))
        kept = [run for run in every if scanner.runs.inner(text, run) is not None]
        found = [run for run in kept if _finds(scanner, text, run)]
        short = all(len(decode_run(text, run) or b"") < SEGMENT for run in every)
        clean = gate.runs_clean(text.encode("latin-1"))
        assert not (clean and found), (text, found)
        if short:
            assert clean == (not kept), (text, kept)
            agreed += 1
        elif clean:
            long_clean += 1
        else:
            looked += 1
    assert agreed > 500 and long_clean > 500 and looked > 100, (agreed, long_clean, looked)
    # A literal only one reading of a run finds: the URL alphabet's `-` before it, hex
    # from its second digit (inside a stretch, and a whole stretch of odd length),
    # base64 from its third and fourth character, digits that a run of lower-case hex
    # takes further than the upper case's (the regex tries lower case first).
    literal = b"x://ab:cd@e.fghi"  # (16 bytes)
    for text in (base64.urlsafe_b64encode(b"Ab\x3e" + literal[1:15]).decode(),
                 "ga" + literal.hex(), "Qx" + base64.b64encode(literal[:15]).decode(),
                 "Qxy" + base64.b64encode(literal[:15]).decode(),
                 "a" + literal.hex(), "g" + "11" * 16 + b"://".hex()):
        assert [r for r in runs(text) if scanner.runs.inner(text, r) is not None], text
        assert not gate.runs_clean(text.encode()), text


def test_runs_clean_reads_both_base64_alphabets() -> None:
    """`-` and `_` are read as `+` and `/` (the URL alphabet): a literal whose encoding
    holds them (`~~~` makes a 62) is found in the decoded bytes from either alphabet."""
    import base64

    gate = _gate.Gate(_ALPHABET, SEGMENT, [(b"~~~", False)])
    data = b"xyz~~~abcdefghij"
    for text in (base64.urlsafe_b64encode(data), base64.b64encode(data)):
        assert b"-" in text or b"+" in text
        assert not gate.runs_clean(text), text
    assert gate.runs_clean(base64.urlsafe_b64encode(b"xyz~~-abcdefghij"))
