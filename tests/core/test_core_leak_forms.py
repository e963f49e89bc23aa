"""The leak guard's forms (`core/leak_forms.py`): the canonical form in one pass where it
can, read as the passes in turn read it, and the markers of a value."""

from __future__ import annotations

import base64
import random
import re

from gateway.core.leak_forms import canonical, sensitive_markers

_PERCENT = re.compile(rb"%([0-9A-Fa-f]{2})")
_JSON_U = re.compile(rb"\\u00([0-9A-Fa-f]{2})")


def _byte(match: re.Match[bytes]) -> bytes:
    return bytes([int(match.group(1), 16)])


def _in_turn(data: bytes) -> bytes:
    """%XX up to three times, then JSON's `\\u00XX`, then `\\/`, each over the whole
    data in turn, lowercased."""
    for _ in range(3):
        data = _PERCENT.sub(_byte, data)
    return _JSON_U.sub(_byte, data).replace(b"\\/", b"/").lower()


def test_the_canonical_form_is_the_passes_in_turn() -> None:
    """Data built of the escapes' pieces (a `\\u005c` or `\\u002f` that makes a `\\/`, a
    %25 that makes a %XX, backslashes escaping backslashes, case)."""
    r = random.Random(61)
    atoms = [b"\\", b"/", b"u", b"0", b"00", b"u00", b"5c", b"5C", b"2f", b"2F", b"41", b"%",
             b"%25", b"%5C", b"%2F", b"a", b"Z", b"\\u00", b"\\/", b"\\\\", b"%5c%2f",
             b"%2525", b"%252525", b"\\u005c/", b"\\u002F"]
    for _ in range(100_000):
        data = b"".join(r.choice(atoms) for _ in range(r.randrange(1, 12)))
        assert canonical(data) == _in_turn(data), data


def test_a_value_is_found_in_each_encoding_through_the_canonical_form() -> None:
    value = b"sk-test-0123456789abcdefABCDEF"
    markers = sensitive_markers(value)
    for sent in (value, value.hex().upper().encode(), base64.b64encode(value),
                 base64.urlsafe_b64encode(b"xy" + value), base64.b32encode(value),
                 b"%25" + b"".join(b"%%%02X" % c for c in value)):
        seen = canonical(b'{"a": "' + sent + b'"}')
        assert any(m in seen for m in markers), sent
