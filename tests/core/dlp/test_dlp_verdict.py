"""What findings decide under a rule's `dlp:` (core/dlp/verdict.py): which count on a
host, the refusal's words (the detector and where, what to change, never the value) and
the audit records."""

from __future__ import annotations

import pytest

from gateway.core.dlp import Dlp, DlpAllow, Finding, Location
from gateway.core.dlp.verdict import SecretDetected, counted, records, refusal, unreadable
from gateway.core.policy.hosts import compile_host_pattern
from gateway.core.refusal import answer, status_of

GITHUB = Finding("github", Location("header", "X-Deploy"), "a" * 16)
PYPI = Finding("pypi", Location("body", "$.token"), "b" * 16)
KEYWORD = Finding("keyword", Location("body", "$.password"), "c" * 16)
ALLOW_PYPI = DlpAllow("pypi", (compile_host_pattern("upload.pypi.org"),))


@pytest.mark.parametrize(("dlp", "host", "want"), [
    (Dlp(), "example.test", [GITHUB, PYPI]),                   # (keyword is opt-in)
    (Dlp(allow=(ALLOW_PYPI,)), "upload.pypi.org", [GITHUB]),    # allowed to its registry
    (Dlp(allow=(ALLOW_PYPI,)), "evil.test", [GITHUB, PYPI]),    # ... and nowhere else
    (Dlp(detectors=("keyword",)), "example.test", [KEYWORD]),
    (Dlp(enabled=False), "example.test", []),
])
def test_what_counts_on_a_host(dlp: Dlp, host: str, want: list[Finding]) -> None:
    assert list(counted(dlp, [GITHUB, PYPI, KEYWORD], host)) == want


def test_the_refusal_names_detector_and_where_and_what_to_change() -> None:
    found = records([GITHUB], "refuse")
    refused = refusal((GITHUB,), "paste.test", "p/a.yaml:7", found)
    assert isinstance(refused, SecretDetected) and refused.found is found
    assert (refused.code, refused.rule, status_of(refused.code)) == \
        ("secret_detected", "p/a.yaml:7", 403)
    assert "github in header X-Deploy" in refused.reason
    assert "{detector: github, hosts: [paste.test]}" in refused.reason
    assert "dlp.allow" in refused.reason and "dlp.detectors" in refused.reason
    assert b"secret_detected" in answer(refused).body
    assert found == [{"detector": "github", "where": "header X-Deploy",
                      "fingerprint": "a" * 16, "action": "refuse"}]


def test_many_findings_are_counted_not_all_named() -> None:
    many = tuple(Finding("aws", Location("body", f"$.k{i}"), f"{i:016x}") for i in range(5))
    reason = refusal(many, "h.test", None, []).reason
    assert "$.k2" in reason and "$.k3" not in reason and "and 2 more" in reason


def test_an_unreadable_body_is_refused_saying_why() -> None:
    refused = unreadable("gzip: not a gzip stream", "h.test", "p/a.yaml:3")
    assert refused.code == "secret_detected" and refused.found == []
    assert "cannot be checked for credentials" in refused.reason
    assert "gzip: not a gzip stream" in refused.reason
