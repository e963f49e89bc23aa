"""Shared conformance data: host_matching and pattern_rejects must all pass."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from conformance import CASES_FILE

from gateway.core.policy import (
    HostPatternError,
    Request,
    compile_host_pattern,
    decide,
    host_matches,
    normalize_host,
)
from gateway.services.policy import PolicyError, load_policy_text


def _load() -> dict[str, Any]:
    if not CASES_FILE.is_file():
        return {}
    data: dict[str, Any] = yaml.safe_load(CASES_FILE.read_text(encoding="utf-8"))
    return data


DATA = _load()
needs_data = pytest.mark.skipif(not DATA, reason=f"conformance data not found at {CASES_FILE}")


def _matching_cases() -> list[Any]:
    out = []
    for source, cases in (DATA.get("host_matching") or {}).items():
        for i, (host, pattern, expected) in enumerate(cases):
            out.append(pytest.param(host, pattern, expected, id=f"{source}-{i}-{host}-{pattern}"))
    return out


def _reject_cases() -> list[Any]:
    out = []
    for source, patterns in (DATA.get("pattern_rejects") or {}).items():
        if source.endswith("_notes"):
            continue
        for pattern in patterns:
            # codex lists "* (in denylist: ...)": the pattern is the first word
            text = pattern.split(" (", 1)[0] if " (" in pattern else pattern
            out.append(pytest.param(text, id=f"{source}-{text}"))
    return out


@needs_data
@pytest.mark.parametrize(("host", "pattern", "expected"), _matching_cases())
def test_host_matching(host: str, pattern: str, expected: bool) -> None:
    """Both through host_matches and through a loaded policy's indexed matcher."""
    patterns = pattern.split("|")
    assert any(host_matches(host, p) for p in patterns) is expected

    valid: list[str] = []
    for p in patterns:
        try:
            valid.append(compile_host_pattern(p, allow_unicode=True).text)
        except HostPatternError:
            assert expected is False  # an invalid pattern matches nothing
    if not valid:
        return
    rules = "".join(f'  - host: "{p}"\n' for p in valid)
    policy = load_policy_text("c.yaml", f"version: v1\nname: c\negress:\n{rules}").policies["c"]
    try:
        normalized = normalize_host(host)
    except ValueError:  # DestinationError: not a host at all
        assert expected is False
        return
    decision = decide(policy, Request("GET", "https", normalized, 443, "/"))
    assert decision.allowed is expected, decision.reason


@needs_data
@pytest.mark.parametrize("pattern", _reject_cases())
def test_pattern_rejects(pattern: str) -> None:
    with pytest.raises(HostPatternError) as info:
        compile_host_pattern(pattern)
    assert len(str(info.value)) > 20
    text = yaml.safe_dump({"version": "v1", "name": "c", "egress": [{"host": pattern}]})
    with pytest.raises(PolicyError) as policy_info:
        load_policy_text("c.yaml", text)
    [error] = policy_info.value.errors
    assert error.startswith("c.yaml:")


@needs_data
def test_non_punycode_hint_mirrors_smokescreen() -> None:
    with pytest.raises(HostPatternError) as info:
        compile_host_pattern("éxämple.com")
    assert 'use "xn--xmple-gra7a.com"' in str(info.value)


def test_cases_file_location() -> None:
    if not CASES_FILE.is_file():
        pytest.skip(f"conformance data not found at {CASES_FILE} (expected ../shared beside repo)")
    assert DATA.get("host_matching") and DATA.get("pattern_rejects")
