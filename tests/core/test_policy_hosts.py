"""Host normalisation, host pattern validation and matching."""

from __future__ import annotations

import pytest

from gateway.core.policy.hosts import (
    HostPatternError,
    compile_host_pattern,
    host_matches,
    is_public_suffix,
)


@pytest.mark.parametrize(
    ("pattern", "kind", "suffix"),
    [
        ("api.example.com", "exact", "api.example.com"),
        ("API.Example.com.", "exact", "api.example.com"),
        ("*.example.com", "subdomains", "example.com"),
        ("**.example.com", "self_and_subdomains", "example.com"),
        ("region*.v2.argotunnel.com", "glob", "v2.argotunnel.com"),
        ("*-aiplatform.googleapis.com", "glob", "googleapis.com"),
        ("*.s3.*.amazonaws.com", "glob", "amazonaws.com"),
        ("*.githubusercontent.com", "subdomains", "githubusercontent.com"),  # private PSL
        ("*.s3.amazonaws.com", "subdomains", "s3.amazonaws.com"),
        ("10.1.2.3", "ip", "10.1.2.3"),
        ("[::1]", "ip", "::1"),
        ("2001:DB8::1", "ip", "2001:db8::1"),
        ("xn--e1aybc.example.com", "exact", "xn--e1aybc.example.com"),
    ],
)
def test_accepted_patterns(pattern: str, kind: str, suffix: str) -> None:
    compiled = compile_host_pattern(pattern)
    assert compiled.kind == kind
    assert compiled.suffix == suffix


@pytest.mark.parametrize(
    ("pattern", "hint"),
    [
        ("https://example.com", "drop it"),
        ("example.com:443", "ports:"),
        ("example.com/v1", "paths:"),
        ("éxämple.com", 'use "xn--xmple-gra7a.com"'),
        ("not-a-domain", "single label"),
        ("localhost", "single label"),
        ("*", "every host"),
        ("**", "every host"),
        ("*.", "every host"),
        ("*.com", "public suffix 'com'"),
        ("**.com", "public suffix"),
        ("*.co.uk", "public suffix 'co.uk'"),
        ("*example.com", "missing dot"),
        ("*bob.example.com", "did you mean '*.bob.example.com'"),
        ("ex*ample.com", "middle of a label"),
        ("bob.ex*ample.com", "starts with '*.'"),
        ("api.*.example.com", "starts with '*.'"),
        ("*.*.stripe.com", "two wildcard labels"),
        ("example.*", "top-level label"),
        ("foo.us-*.example.com", "starts with '*.'"),
        ("foo.**.example.com", "starts with '*.'"),
        ("foo**.example.com", "whole label"),
        ("a..example.com", "empty label"),
        ("1.2.3", "neither"),
        ("bad_label-.example.com", "invalid label"),
        ("*-.example.com", "invalid label"),
        ("", "empty"),
    ],
)
def test_rejected_patterns(pattern: str, hint: str) -> None:
    with pytest.raises(HostPatternError) as info:
        compile_host_pattern(pattern)
    assert hint in str(info.value)


def test_unicode_pattern_allowed_when_comparing() -> None:
    assert compile_host_pattern("тест.example.com", allow_unicode=True).text == (
        "xn--e1aybc.example.com"
    )


@pytest.mark.parametrize(
    ("host", "pattern", "want"),
    [
        ("a.example.com", "*.example.com", True),
        ("a.b.example.com", "*.example.com", True),
        ("example.com", "*.example.com", False),
        ("badexample.com", "*.example.com", False),
        ("badexample.com", "**.example.com", False),
        ("example.com", "**.example.com", True),
        ("us-central1-aiplatform.googleapis.com", "*-aiplatform.googleapis.com", True),
        ("aiplatform.googleapis.com", "*-aiplatform.googleapis.com", False),
        ("x.us-aiplatform.googleapis.com", "*-aiplatform.googleapis.com", False),
        ("bucket.s3.us-east-1.amazonaws.com", "*.s3.*.amazonaws.com", True),
        ("a.b.s3.us-east-1.amazonaws.com", "*.s3.*.amazonaws.com", True),
        ("s3.us-east-1.amazonaws.com", "*.s3.*.amazonaws.com", False),
        ("bucket.s3.a.b.amazonaws.com", "*.s3.*.amazonaws.com", False),
        ("2001:db8::1", "[2001:DB8::1]", True),
        ("10.0.0.1", "10.0.0.1", True),
        ("10.0.0.10", "10.0.0.1", False),
        ("", "example.com", False),
    ],
)
def test_matching(host: str, pattern: str, want: bool) -> None:
    assert host_matches(host, pattern) is want


@pytest.mark.parametrize(
    ("domain", "want"),
    [
        ("com", True),
        ("co.uk", True),
        ("uk", True),
        ("example.com", False),
        ("githubusercontent.com", False),  # private section ignored
        ("github.io", False),
        ("s3.amazonaws.com", False),
        ("unknowntld", True),  # the PSL's implicit "*" rule
        ("example.internal", False),
    ],
)
def test_public_suffix_icann_only(domain: str, want: bool) -> None:
    assert is_public_suffix(domain) is want


def test_public_suffix_list_is_read_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The PSL comes from the file vendored with publicsuffix2, never from the network."""
    import socket

    from gateway.core.policy import hosts

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    hosts._icann_psl.cache_clear()
    try:
        assert is_public_suffix("co.uk")
        assert not is_public_suffix("githubusercontent.com")
    finally:
        hosts._icann_psl.cache_clear()
