"""The C-speed passes (`fastscan`): Hyperscan and the fallback (pyahocorasick, translate)
give the same answers as a plain search, on prose, binary bytes, text past latin-1 and
every default anchor planted at the edges and overlapping; scans from several threads at
once each get their own scratch space."""

from __future__ import annotations

import random
import threading

import pytest

from gateway.core.dlp import DEFAULT
from gateway.core.dlp.fastscan import HYPERSCAN, SEGMENT, Literals, has_segment
from gateway.services.dlp.library import build

ANCHORS = sorted({a for d in build(DEFAULT) for r in d.rules for a in r.anchors})
MODES = [pytest.param(True, marks=pytest.mark.skipif(not HYPERSCAN, reason="no hyperscan")),
         False]


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


@pytest.mark.parametrize("fast", MODES)
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
def test_a_segment_is_twenty_base64_characters_in_a_row(fast: bool, text: str,
                                                        holds: bool) -> None:
    assert has_segment(text, fast=fast) is holds


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
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(20):
                assert set(literals.find(text)) == want
                assert not has_segment(text[:400_000])
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:1]
