"""What a scan reports: the detector, where, and a salted fingerprint - never the value.

The fingerprint is HMAC-SHA256 of the value under a per-deployment salt, truncated to
16 hex digits (64 bits): the same secret gives the same fingerprint on every line of one
deployment, so an operator can tell one leaked key from many, and a line cannot be
turned back into the value (nor compared across deployments, whose salts differ).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["HIDDEN_NAME", "Finding", "Hit", "Location", "ScanResult", "findings_of", "fingerprint"]

FINGERPRINT_HEX = 16


def fingerprint(salt: bytes, value: str) -> str:
    """The salted fingerprint of a value (16 hex digits)."""
    digest = hmac.new(salt, value.encode("utf-8", "surrogatepass"), hashlib.sha256)
    return digest.hexdigest()[:FINGERPRINT_HEX]


@dataclass(frozen=True, slots=True)
class Location:
    """Where a value was: `part` is "request line", "query", "header" or "body";
    `name` the header name, query or form field, JSON path or multipart part; `offset`
    the character offset in the body (or in the decoded text of `via`); `via` the
    decodings the value was found under (gzip, base64, hex, percent)."""

    part: str
    name: str = ""
    offset: int | None = None
    via: tuple[str, ...] = ()

    def __str__(self) -> str:
        text = self.part
        if self.name:
            text += f" {self.name}"
        if self.offset is not None and (not self.name or self.via):
            text += f" at offset {self.offset}"
        if self.via:
            text += f" (in {', '.join(self.via)})"
        return text

    def under(self, kind: str, offset: int | None) -> Location:
        """This location, one decoding deeper."""
        return Location(self.part, self.name, offset, (*self.via, kind))


@dataclass(frozen=True, slots=True)
class Finding:
    """One credential found: which detector, where, and its salted fingerprint."""

    detector: str
    location: Location
    fingerprint: str

    def describe(self) -> str:
        """For refusals and audit lines: never holds the value."""
        return f"{self.detector} in {self.location} (fingerprint {self.fingerprint})"


@dataclass(frozen=True, slots=True)
class ScanResult:
    """A scan's findings, or why the body could not be read (`unreadable`: the caller
    refuses where the check applies, as for any body it cannot read)."""

    findings: tuple[Finding, ...] = ()
    unreadable: str | None = None

    @property
    def clean(self) -> bool:
        return not self.findings and self.unreadable is None


HIDDEN_NAME = "(a name holding a credential)"
_OVERLAP = 8  # characters of a value a name may not show


def shown(where: Location, values: set[str]) -> Location:
    """`where` as a finding may show it: without its name (a header, field or part
    name, a JSON key in a path) where that name holds any part of a value found (the
    value itself, or any 8 of its characters in a row)."""
    if where.name and any(_overlaps(v, where.name) for v in values):
        return Location(where.part, HIDDEN_NAME, where.offset, where.via)
    return where


def _overlaps(value: str, name: str) -> bool:
    """Whether `name` shows `value` or any 8 characters of it in a row."""
    if len(value) <= _OVERLAP:
        return value in name
    return any(value[i:i + _OVERLAP] in name for i in range(len(value) - _OVERLAP + 1))


@dataclass(frozen=True, slots=True)
class Hit:
    """A value found, before it is fingerprinted (internal: redaction needs the value)."""

    detector: str
    location: Location
    value: str


def findings_of(hits: Iterable[Hit], salt: bytes) -> tuple[Finding, ...]:
    """Findings of hits, one per (detector, value), first location kept. A location
    whose name (a header, field or part name, a JSON key in a path) holds any part of
    a value found is shown without that name: a finding never carries a value."""
    hits = list(hits)
    values = {h.value for h in hits}
    seen: dict[tuple[str, str], Finding] = {}
    for hit in hits:
        mark = fingerprint(salt, hit.value)
        if (hit.detector, mark) not in seen:
            seen[(hit.detector, mark)] = Finding(hit.detector, shown(hit.location, values),
                                                 mark)
    return tuple(seen.values())
