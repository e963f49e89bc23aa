"""The gateway's logging: its handlers, and one redaction at their boundary.

Secrets never reach a log line, by construction: every handler the gateway installs
(`configure`: the stderr handler every record reaches, mitmproxy's included;
`protect`, called again once uvicorn and mitmproxy have added theirs) carries one
filter, `REDACTION`, that rewrites each record before any handler formats it — the
final message and the formatted exception and stack text — replacing:

- every value a registered source knows (`SOURCES`: the secret caches, keys and minted
  credentials, register themselves; other code adds a source with `SOURCES.add` and
  calls `SOURCES.changed()` when its values change), in every encoding the leak scanner
  knows (`core.leak_forms.sensitive_markers` and `SecretValue.variants()`: raw, base64
  (also inside a longer blob), hex, base32, URL-encoded, any case);
- every gateway token: JWT-shaped text starting with the constant header every token
  carries (`core.credentials.TOKEN_PREFIX`), and a token's claims without its header
  (registered per issuer by the gateway), in the same encodings.

A match and the run of token characters around it become ``[REDACTED]``. A message in
which a secret shows only once ``%XX`` or ``\\u00XX`` escapes are decoded is withheld
whole. The markers are rebuilt only when `SOURCES.version` moves; a record without a
secret costs one lowercase copy and a substring test per marker. Nothing runs per
request. Our own log messages never quote upstream bytes in the first place
(`core.phrases.error_phrase`; mitmproxy's through `engines.patches.install_log_hygiene`).
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import re
import sys
import threading
from collections.abc import Callable, Iterable

from gateway.core.credentials import TOKEN_PREFIX
from gateway.core.leak_forms import canonical, sensitive_markers
from gateway.core.secret_value import SecretValue, encoding_variants

__all__ = ["MIN_SECRET", "REDACTED", "REDACTION", "SOURCES", "Redaction", "SecretSources",
           "configure", "protect", "token_claims"]

REDACTED = "[REDACTED]"
WITHHELD = "[log message withheld: it held a secret in an encoding that could not be cut out]"
UNFORMATTABLE = "[log message withheld: its arguments did not format]"
MIN_SECRET = 8  # shorter values are no credentials; as markers they would match at random
_RUN_BEFORE = r"[A-Za-z0-9+/_.-]*"
_RUN_AFTER = r"[A-Za-z0-9+/_.=-]*"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

Source = Callable[[], Iterable[SecretValue | str]]


def token_claims(issuer: str) -> str:
    """The base64url text every token of ``issuer`` starts its claims with (whole
    base64 groups of ``{"iss":issuer,"aud":"sandbox-gateway",``): a token with its
    header cut off still carries it."""
    claims = json.dumps({"iss": issuer, "aud": "sandbox-gateway"},
                        separators=(",", ":")).encode()[:-1] + b","
    return base64.urlsafe_b64encode(claims[: len(claims) - len(claims) % 3]).decode()


def _markers(value: str, variants: Iterable[bytes]) -> set[bytes]:
    return set(sensitive_markers(value.encode("utf-8"))) | {v.lower() for v in variants}


class SecretSources:
    """What log lines must never show: named sources of secret values, pluggable.

    A source is a function returning the values it knows now (`SecretValue`s or
    strings); it is called only when the markers are rebuilt, after `changed()`."""

    def __init__(self) -> None:
        self._sources: dict[str, Source] = {}
        self.version = 0

    def add(self, name: str, source: Source) -> None:
        """Register (or replace) source ``name``."""
        self._sources[name] = source
        self.changed()

    def remove(self, name: str) -> None:
        if self._sources.pop(name, None) is not None:
            self.changed()

    def changed(self) -> None:
        """A source's values changed: the markers are rebuilt before the next record."""
        self.version += 1

    def markers(self) -> frozenset[bytes]:
        """Lowercase markers of every value of every source, and of every token."""
        out = set(_TOKEN_MARKERS)
        for source in list(self._sources.values()):
            for value in source():
                if isinstance(value, SecretValue):
                    for piece in value.pieces():
                        if len(piece) >= MIN_SECRET:
                            out |= _markers(piece, value.variants())
                elif len(value) >= MIN_SECRET:
                    out |= _markers(value, encoding_variants(value))
        return frozenset(m for m in out if m)


_TOKEN_MARKERS = frozenset(_markers(TOKEN_PREFIX, encoding_variants(TOKEN_PREFIX)))


@functools.lru_cache(maxsize=64)
def _pattern(hits: tuple[str, ...]) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(h) for h in sorted(hits, key=len, reverse=True))
    return re.compile(f"{_RUN_BEFORE}(?:{alternatives}){_RUN_AFTER}", re.IGNORECASE)


class Redaction(logging.Filter):
    """The filter on every handler: redacts each record once, in place (see the module
    docstring), and never drops one."""

    def __init__(self, sources: SecretSources) -> None:
        super().__init__()
        self.sources = sources
        self._lock = threading.Lock()
        self._version = -1
        self._text: tuple[str, ...] = ()
        self._bytes: tuple[bytes, ...] = ()

    def _current(self) -> tuple[tuple[str, ...], tuple[bytes, ...]]:
        if self._version != self.sources.version:
            with self._lock:
                version = self.sources.version
                try:
                    found = self.sources.markers()
                except Exception:  # a failing source: keep what we had, try again next time
                    return self._text or tuple(m.decode() for m in _TOKEN_MARKERS), \
                        self._bytes or tuple(_TOKEN_MARKERS)
                self._bytes = tuple(sorted(found, key=len, reverse=True))
                self._text = tuple(dict.fromkeys(
                    m.decode("utf-8", "replace").lower() for m in self._bytes))
                self._version = version
        return self._text, self._bytes

    def redact(self, text: str) -> str:
        """``text`` with every known secret and token cut out (or withheld whole)."""
        markers, raw = self._current()
        lowered = text.lower()
        hits = tuple(m for m in markers if m in lowered)
        if hits:
            text = _pattern(hits).sub(REDACTED, text)
            lowered = text.lower()
            if any(m in lowered for m in markers):
                return WITHHELD
        if "%" in text or "\\" in text:
            decoded = canonical(text.encode("utf-8", "surrogateescape"))
            if any(m in decoded for m in raw):
                return WITHHELD
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_sgw_redacted", False):
            return True
        try:
            message = record.getMessage()
        except Exception:
            message = UNFORMATTABLE  # (logging would print the arguments to stderr)
        record.msg, record.args = self.redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
            record.exc_info = None  # formatters print exc_text; none formats the original
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)
        record._sgw_redacted = True  # once, by the first handler that sees it
        return True


SOURCES = SecretSources()
REDACTION = Redaction(SOURCES)


def protect() -> None:
    """Put `REDACTION` on every handler of every logger, the root's included
    (idempotent). Call it again after a library adds handlers."""
    loggers: list[logging.Logger] = [logging.getLogger()]
    loggers += [lg for lg in logging.Logger.manager.loggerDict.values()
                if isinstance(lg, logging.Logger)]
    for logger in loggers:
        for handler in list(logger.handlers):
            if REDACTION not in handler.filters:
                handler.addFilter(REDACTION)


def configure(level: str) -> None:
    """`run`'s logging: one stderr handler for every record (mitmproxy's at WARNING and
    above, hpack's at INFO), redacted."""
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format=_FORMAT)
    logging.getLogger("mitmproxy").setLevel(logging.WARNING)
    # hpack logs every HTTP/2 header block it codes at DEBUG, raw and Huffman-coded (an
    # encoding no redaction can see into): keys and tokens. Never below INFO.
    logging.getLogger("hpack").setLevel(logging.INFO)
    protect()
