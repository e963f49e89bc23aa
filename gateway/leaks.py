"""Leak detection: gateway tokens or real keys where they must not go, and redaction
of keys an upstream echoes back.

Detection looks for fixed byte markers in every encoding a client could use (raw,
base64 at each alignment, URL-encoded): the constant start of every gateway token
(its JOSE header) and the variants of each real key the gateway has fetched. The
response redactor works on streamed chunks without buffering them: it holds back
only a chunk's tail that could be the start of a key, and releases it with the next
chunk (or at the end).
"""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Iterable

from gateway.secrets.value import encoding_variants

REDACTED = b"[REDACTED]"

# Every gateway token starts with this JOSE header prefix (PyJWT sorts header keys).
_TOKEN_HEADER = base64.urlsafe_b64encode(
    json.dumps({"alg": "EdDSA", "kid": ""}, separators=(",", ":")).encode()[:21]
).decode()
TOKEN_PREFIX = _TOKEN_HEADER
TOKEN_MARKERS: tuple[bytes, ...] = encoding_variants(_TOKEN_HEADER)


def contains_any(data: bytes, markers: Iterable[bytes]) -> bool:
    """True if any marker occurs in `data`."""
    return any(m in data for m in markers)


def request_blob(method: str, path: str, headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The parts of a request a leak can hide in, as one byte string (body apart)."""
    parts = [method.encode(), b" ", path.encode("utf-8", "surrogateescape"), b"\n"]
    for name, value in headers:
        parts += [name, b": ", value, b"\n"]
    return b"".join(parts)


class Redactor:
    """A response-stream filter replacing `secrets` (all variants) by [REDACTED]."""

    def __init__(self, variants: Iterable[bytes]) -> None:
        self.variants = tuple(sorted(set(variants), key=len, reverse=True))
        self._prefixes = _prefixes(self.variants)
        self._longest = len(self.variants[0]) if self.variants else 0
        self._held = b""
        self.redactions = 0

    def redact(self, data: bytes) -> bytes:
        """Replace every occurrence in a complete byte string."""
        for v in self.variants:
            if v in data:
                self.redactions += data.count(v)
                data = data.replace(v, REDACTED)
        return data

    def __call__(self, chunk: bytes) -> list[bytes]:
        """Filter one streamed chunk (b"" marks the end). Never emits an empty chunk:
        mitmproxy would send it as the terminating chunk of a chunked body."""
        if not chunk:  # end of stream: release what was held back
            held, self._held = self._held, b""
            return [self.redact(held)] if held else []
        data = self.redact(self._held + chunk)
        keep = self._partial_tail(data)
        self._held = data[len(data) - keep:] if keep else b""
        out = data[: len(data) - keep]
        return [out] if out else []

    def _partial_tail(self, data: bytes) -> int:
        """Length of the longest tail of `data` that is a proper prefix of a variant."""
        prefixes = self._prefixes
        for n in range(min(self._longest - 1, len(data)), 0, -1):
            if data[-n:] in prefixes:
                return n
        return 0


@functools.lru_cache(maxsize=256)
def _prefixes(variants: tuple[bytes, ...]) -> frozenset[bytes]:
    """Every proper prefix of every variant (computed once per secret)."""
    return frozenset(v[:n] for v in variants for n in range(1, len(v)))
