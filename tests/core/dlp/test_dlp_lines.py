"""Base64 written in lines (`core/dlp/lines.py`): the blocks `wrapped` finds among a
text's stretches, and the same found in C (`_gate.key_blocks`) on random texts."""

from __future__ import annotations

import random

import pytest
from helpers.lines import random_lines

from gateway.core.dlp import lines
from gateway.core.dlp.decoding import stretches


def test_the_c_blocks_are_wrappeds() -> None:
    """`_gate.key_blocks` (the stretches and their blocks of lines in one C call) finds
    what `lines.wrapped(escaped=True)` finds over `stretches`, with and without the
    views' joins, on random texts of lines around the line bound and every break."""
    if lines._key_blocks is None:
        pytest.skip("the C gate is not built")
    r = random.Random(20)
    for _ in range(20_000):
        text = random_lines(r, (0, 2, 19, 20, 21, 24, 28, 40))
        joins = sorted({r.randrange(len(text) + 1) for _ in range(r.randint(0, 3))})
        listed = list(stretches(text))
        expected = (listed, list(lines.wrapped(text, listed, True, joins)))
        assert lines._key_blocks(text.encode("latin-1"), joins) == expected, (
            text, joins)
