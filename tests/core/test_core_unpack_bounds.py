"""What unpacking may cost beyond one body's bound (`core/unpack_bounds.py`): a sandbox's
`Excess` is charged what its compressed data unpacks to past `AMPLE` times its size,
across its bodies, and refuses past it; ordinary archives are never charged. (What of a
stream may go on, `Undecided`: tests/core/test_core_archives.py.)"""

from __future__ import annotations

import gzip
import random

import pytest
from backports import zstd

from gateway.core.archives import Unpacker
from gateway.core.encodings import EncodingError
from gateway.core.unpack_bounds import AMPLE, Excess, charge_to, charged_to

_RNG = random.Random(3)
WORDS = b" ".join(b"%06x" % _RNG.getrandbits(24) for _ in range(100_000))


def _unpack(data: bytes, kind: str = "gzip") -> int:
    return sum(len(piece) for _, piece in Unpacker(kind).feed(data))


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_bombs_are_charged_to_their_sandbox_across_bodies(kind: str) -> None:
    """Each body is within its own bound (64 MiB and 64 times its size): the sandbox's
    excess refuses the third."""
    bomb = gzip.compress(b"\0" * (10 << 20), mtime=0) if kind == "gzip" else \
        zstd.compress(b"\0" * (10 << 20))
    excess = Excess(25 << 20, 1 << 20)
    charge_to(excess)
    try:
        assert _unpack(bomb, kind) == 10 << 20
        assert _unpack(bomb, kind) == 10 << 20
        with pytest.raises(EncodingError, match="this sandbox's compressed data"):
            _unpack(bomb, kind)
    finally:
        charge_to(None)
    assert excess.left < 0
    assert _unpack(bomb, kind) == 10 << 20  # (no sandbox's excess set: its own bound)


def test_a_zip_entry_is_charged_by_its_own_bytes_not_the_bodys_after_it() -> None:
    """A zip entry's stream is given the rest of the piece it starts in (its end is its
    stream's): what it unpacks to is charged past `AMPLE` times the bytes it read, not
    the piece's (a small bomb entry followed by 1 MiB of other bytes was charged
    nothing: 16 MiB of room a piece)."""
    import zlib

    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    bomb = packer.compress(b"\0" * (4 << 20)) + packer.flush()
    charged = []
    for after in (b"", bytes(1 << 20)):
        excess = Excess(1 << 30, 1)
        charge_to(excess)
        try:
            assert _unpack(bomb + after, "deflate") == 4 << 20
        finally:
            charge_to(None)
        charged.append((1 << 30) - excess.left)
    assert charged[0] == charged[1] == (4 << 20) - AMPLE * len(bomb)


def test_ordinary_archives_are_not_charged() -> None:
    packed = gzip.compress(WORDS, mtime=0)
    assert len(WORDS) < AMPLE * len(packed)  # (text packs 3 to 10 times)
    excess = Excess(1, 1)
    charge_to(excess)
    try:
        for _ in range(20):
            assert _unpack(packed) == len(WORDS)
    finally:
        charge_to(None)
    assert excess.left == 1


def test_what_is_charged_is_the_part_past_ample_times_the_bytes() -> None:
    bomb = gzip.compress(b"\0" * (4 << 20), mtime=0)
    excess = Excess(1 << 30, 1)
    charge_to(excess)
    try:
        _unpack(bomb)
    finally:
        charge_to(None)
    assert (1 << 30) - excess.left == (4 << 20) - AMPLE * len(bomb)


def test_what_is_charged_to_is_said_and_unsaid() -> None:
    excess = Excess(1, 1)
    charge_to(excess)
    assert charged_to() is excess
    charge_to(None)
    assert charged_to() is None
