"""Findings say the detector, where, and a salted fingerprint: locations as a refusal
writes them, fingerprints stable per salt and different across salts."""

from __future__ import annotations

import pytest

from gateway.core.dlp import Finding, Location, ScanResult, fingerprint


@pytest.mark.parametrize(("location", "text"), [
    (Location("request line"), "request line"),
    (Location("header", "Authorization"), "header Authorization"),
    (Location("query", "key"), "query key"),
    (Location("body", "$.messages[2].content"), "body $.messages[2].content"),
    (Location("body", offset=120), "body at offset 120"),
    (Location("body", "form field token", None, ("gzip",)), "body form field token (in gzip)"),
    (Location("body", offset=0).under("base64", 40), "body at offset 40 (in base64)"),
    (Location("body", "$.f").under("base64", None).under("hex", 3),
     "body $.f at offset 3 (in base64, hex)"),
])
def test_locations_read_as_refusals_write_them(location: Location, text: str) -> None:
    assert str(location) == text


def test_fingerprints() -> None:
    one = fingerprint(b"salt-a", "AKIAXXXXXXXXXXXXXXXX")
    assert one == fingerprint(b"salt-a", "AKIAXXXXXXXXXXXXXXXX")
    assert one != fingerprint(b"salt-b", "AKIAXXXXXXXXXXXXXXXX")
    assert one != fingerprint(b"salt-a", "AKIAXXXXXXXXXXXXXXXY")
    assert len(one) == 16 and int(one, 16) >= 0
    found = Finding("aws", Location("header", "X-Key"), one)
    assert found.describe() == f"aws in header X-Key (fingerprint {one})"


def test_a_result_is_clean_only_without_findings_and_readable() -> None:
    assert ScanResult().clean
    assert not ScanResult(unreadable="corrupt").clean
    assert not ScanResult((Finding("aws", Location("header"), "0" * 16),)).clean
