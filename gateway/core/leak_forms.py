"""What a sensitive value looks like as a client may send it (the leak guard's forms,
`core/leaks.py`): the canonical form data is matched in (`%XX`, also double-encoded, and
JSON `\\u00XX` and `\\/` undone, lowercased) and the markers of a value in it (raw,
hex, base64 and base64url at each byte alignment, base32), for tokens and keys."""

from __future__ import annotations

import base64
import functools
import json
import re

__all__ = ["canonical", "constant_token_markers", "own_token_markers", "sensitive_markers",
           "token_markers", "undone"]

_MIN_FRAGMENT = 12  # bytes of a value a base64/base32 fragment must cover to be a marker
_PERCENT = re.compile(rb"%([0-9A-Fa-f]{2})")
_JSON_U = re.compile(rb"\\u00([0-9A-Fa-f]{2})")


def _pct(match: re.Match[bytes]) -> bytes:
    return bytes([int(match.group(1), 16)])


def canonical(data: bytes) -> bytes:
    """`data` as markers are matched: %XX (twice) and `\\u00XX` decoded, lowercased."""
    return undone(data).lower()


def undone(data: bytes) -> bytes:
    """`data` with %XX (twice) and `\\u00XX` decoded, its case kept (`canonical`)."""
    for _ in range(3):
        if data.find(b"%") < 0:  # (`find`, not `in`: see `_plain`)
            break
        data, undone = _PERCENT.subn(_pct, data)
        if not undone:
            break
    if data.find(b"\\") >= 0:
        # One pass for both JSON escapes (a body of code has a backslash a line, and
        # `bytes.replace(b"\\/", ...)` costs twice the pass there); where a `\\` or `/`
        # was undone, the two in turn, as they may make a `\\/` the second undoes.
        made: list[bytes] = []
        once = _JSON_ESCAPES.sub(lambda m: _json_byte(m, made), data)
        data = once if not made else _JSON_U.sub(_pct, data).replace(b"\\/", b"/")
    return data


_JSON_ESCAPES = re.compile(rb"\\(?:u00([0-9A-Fa-f]{2})|/)")


def _json_byte(match: re.Match[bytes], made: list[bytes]) -> bytes:
    """What `canonical` reads for a JSON escape; a `\\` or `/` it makes is noted."""
    hex_ = match.group(1)
    if hex_ is None:
        return b"/"
    byte = bytes([int(hex_, 16)])
    if byte in (b"\\", b"/"):
        made.append(byte)
    return byte


def sensitive_markers(value: bytes) -> frozenset[bytes]:
    """Canonical markers of `value` in the encodings a client could use."""
    found = {value, value.hex().encode()}
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        full = encode(value)
        found.update((full, full.rstrip(b"=")))
        for skip in (0, 1, 2):
            core = value[skip:]
            core = core[: len(core) - len(core) % 3]
            if len(core) >= _MIN_FRAGMENT:
                found.add(encode(core))
    full32 = base64.b32encode(value)
    found.update((full32, full32.rstrip(b"=")))
    for skip in range(5):
        core = value[skip:]
        core = core[: len(core) - len(core) % 5]
        if len(core) >= _MIN_FRAGMENT:
            found.add(base64.b32encode(core))
    return frozenset(m.lower() for m in found if m)


@functools.lru_cache(maxsize=8)
def constant_token_markers(issuer: str) -> frozenset[bytes]:
    """Markers every gateway token of `issuer` carries: the start of its JOSE header
    (PyJWT sorts header keys: `{"alg":"EdDSA","kid":`) and of its claims
    (`{"iss":issuer,"aud":"sandbox-gateway",`), each as the base64url text a token
    holds — so also a token whose header was cut off."""
    header = b'{"alg":"EdDSA","kid":'
    claims = json.dumps({"iss": issuer, "aud": "sandbox-gateway"},
                        separators=(",", ":")).encode()[:-1] + b","
    out: set[bytes] = set()
    for start in (header, claims):
        whole = start[: len(start) - len(start) % 3]  # whole base64 groups only
        text = base64.urlsafe_b64encode(whole)
        out |= sensitive_markers(text)
    return frozenset(out)


@functools.lru_cache(maxsize=4096)
def own_token_markers(token: str) -> frozenset[bytes]:
    """Markers of one token's own parts: its payload and its signature."""
    out: set[bytes] = set()
    for segment in token.split(".")[1:]:
        if len(segment) >= _MIN_FRAGMENT:
            out |= sensitive_markers(segment.encode("ascii", "replace"))
    return frozenset(out)


def token_markers(token: str, issuer: str) -> frozenset[bytes]:
    """Markers of one token: the constant ones plus its own payload and signature."""
    return constant_token_markers(issuer) | own_token_markers(token)
