"""What a scan reports: the detector, where, and a salted fingerprint - never the value.

The fingerprint is HMAC-SHA256 of the value under a per-deployment salt, truncated to
16 hex digits (64 bits): the same secret gives the same fingerprint on every line of one
deployment, so an operator can tell one leaked key from many, and a line cannot be
turned back into the value (nor compared across deployments, whose salts differ).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

__all__ = ["Finding", "Location", "ScanResult", "fingerprint"]

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
