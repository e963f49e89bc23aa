"""A streamed scan's window (`core/dlp/window.py`): what is read is the bytes added
less those dropped, whatever the pieces' sizes; pieces are never changed."""

from __future__ import annotations

import random
import sys

import pytest

from gateway.core.dlp.window import Window


@pytest.mark.parametrize("seed", range(20))
def test_the_window_reads_what_was_added_less_what_was_dropped(seed: int) -> None:
    r = random.Random(seed)
    window, model = Window(), b""
    for _ in range(200):
        if r.random() < 0.7:
            piece = r.randbytes(r.choice([0, 1, 10, 4095, 4096, 10_000]))
            window.add(piece if r.random() < 0.5 else bytearray(piece))
            model += piece
        elif r.random() < 0.5:
            n = r.randrange(len(model) + 1)
            window.drop(n)
            model = model[n:]
        else:
            assert bytes(window.read()) == model
        assert len(window) == len(model)
    assert bytes(window.read()) == model


def test_a_piece_added_is_never_changed() -> None:
    """The caller forwards what it added (a bytearray from the TLS reader)."""
    small, large = bytearray(b"abc"), bytearray(b"x" * 5000)
    window = Window()
    for piece in (small, large, bytearray(b"def")):
        window.add(piece)
    window.add(b"ghi")
    window.drop(2)
    assert bytes(window.read()) == b"c" + b"x" * 5000 + b"defghi"
    assert small == b"abc" and large == b"x" * 5000


@pytest.mark.parametrize(("size", "kept", "let_go"), [
    (256 << 10, 4096, True), (256 << 10, 50_000, True), (256 << 10, 70_000, False),
    (5000, 100, True), (5000, 2000, False)])
def test_a_large_piece_mostly_dropped_is_let_go(size: int, kept: int, let_go: bool) -> None:
    """What the window keeps of a piece it dropped most of (under a fifth of it kept,
    as a streamed scan keeps a 256 KiB TLS read's last few KiB) is copied out, so that
    the piece itself is freed now (its memory reused by the reader's next buffer while
    it is still in the cache), not when the next piece comes."""
    piece = bytearray(random.Random(size).randbytes(size))
    window = Window()
    window.add(piece)
    alone = sys.getrefcount(piece) - 1  # (the window's reference)
    window.drop(size - kept)
    assert (sys.getrefcount(piece) == alone) is let_go
    assert bytes(window.read()) == piece[-kept:]
    window.add(b"more")
    assert bytes(window.read()) == piece[-kept:] + b"more"
