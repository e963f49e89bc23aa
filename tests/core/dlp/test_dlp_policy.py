"""A `dlp:` section's decision for one finding: selected detectors, allowed hosts, the
rule over the policy, off."""

from __future__ import annotations

import pytest

from gateway.core.dlp import DEFAULT, Dlp, DlpAllow, Finding, Location, resolve
from gateway.core.policy.hosts import compile_host_pattern

PYPI = DlpAllow("pypi", (compile_host_pattern("upload.pypi.org"),
                         compile_host_pattern("*.pypi.test")))


def _f(detector: str) -> Finding:
    return Finding(detector, Location("body"), "0" * 16)


@pytest.mark.parametrize(("dlp", "detector", "host", "applies"), [
    (Dlp(), "github", "a.test", True),
    (Dlp(), "keyword", "a.test", False),  # opt-in
    (Dlp(detectors=("keyword",)), "keyword", "a.test", True),
    (Dlp(detectors=("keyword",)), "github", "a.test", False),
    (Dlp(allow=(PYPI,)), "pypi", "upload.pypi.org", False),
    (Dlp(allow=(PYPI,)), "pypi", "x.pypi.test", False),
    (Dlp(allow=(PYPI,)), "pypi", "paste.example", True),
    (Dlp(allow=(PYPI,)), "github", "upload.pypi.org", True),
    (Dlp(enabled=False), "github", "a.test", False),
])
def test_applies(dlp: Dlp, detector: str, host: str, applies: bool) -> None:
    assert dlp.applies(_f(detector), host) is applies


def test_resolve() -> None:
    policy = Dlp(action="refuse", detectors=DEFAULT)
    rule = Dlp(action="redact", allow=(PYPI,))
    merged = resolve(policy, rule)
    assert merged == Dlp(action="redact", detectors=DEFAULT, allow=(PYPI,))
    assert resolve(policy, Dlp(enabled=False)) is None
    assert resolve(Dlp(enabled=False), None) is None
    assert resolve(None, None) is None
    assert Dlp().effective_action == "refuse"


def test_resolve_is_remembered_per_pair_of_sections() -> None:
    """Every request of a rule asks again: the same pair of sections gives the same
    object; another pair (equal but not the same) its own, as `_resolve` makes it."""
    policy, rule = Dlp(action="report"), Dlp(detectors=("github",))
    first = resolve(policy, rule)
    assert first is resolve(policy, rule)
    other = resolve(Dlp(action="report"), Dlp(detectors=("aws",)))
    assert other is not None and other.detectors == ("aws",)
    assert first is not None and first.detectors == ("github",) and first.action == "report"
    assert resolve(policy, None) is policy
