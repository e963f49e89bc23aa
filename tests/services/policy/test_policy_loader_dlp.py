"""`dlp:` through the loader: on a policy and on a rule, inherited through `extends`,
refused on a raw TCP rule, and what it does to interception (a rule where detection
applies is intercepted, one with `dlp: false` passes through)."""

from __future__ import annotations

import pytest

from gateway.core.dlp import resolve
from gateway.core.policy import PolicySet, Request, decide
from gateway.services.policy import load_policy_texts
from gateway.services.policy.problems import PolicyError

TEXT = """
version: v1
name: base
dlp: {action: redact, detectors: [github, aws]}
egress: []
---
version: v1
name: team
extends: [base]
egress:
  - host: plain.test
  - host: off.test
    dlp: false
  - host: upload.pypi.org
    dlp: {action: report, allow: [{detector: pypi, hosts: [upload.pypi.org]}]}
---
version: v1
name: own
extends: [base]
dlp: {action: refuse}
egress:
  - host: plain.test
---
version: v1
name: none
egress:
  - host: plain.test
  - host: ruled.test
    dlp: true
"""


@pytest.fixture(scope="module")
def policies() -> PolicySet:
    return load_policy_texts({"p/a.yaml": TEXT})


def _tunnel(policies: PolicySet, policy: str, host: str) -> bool:
    return decide(policies.policies[policy], Request(None, "https", host, 443, None)).inspect


@pytest.mark.parametrize(("policy", "host", "inspect"), [
    ("team", "plain.test", True),   # (the policy's dlp:, inherited, applies: read it)
    ("team", "off.test", False),    # dlp: false: passed through
    ("none", "plain.test", False),  # no dlp: anywhere
    ("none", "ruled.test", True),   # the rule's own
])
def test_a_rule_where_detection_applies_is_intercepted(policies: PolicySet, policy: str,
                                                       host: str, inspect: bool) -> None:
    assert _tunnel(policies, policy, host) is inspect


def test_a_policy_inherits_its_parents_section_unless_it_has_its_own(
        policies: PolicySet) -> None:
    team, own = policies.policies["team"], policies.policies["own"]
    assert team.dlp is not None and team.dlp.action == "redact"
    assert team.dlp.detectors == ("github", "aws")
    assert own.dlp is not None and own.dlp.action == "refuse"
    assert policies.policies["none"].dlp is None
    assert policies.uses_dlp


def test_a_rules_section_resolves_over_the_policys(policies: PolicySet) -> None:
    team = policies.policies["team"]
    rule = next(r for r in team.rules if r.host == "upload.pypi.org")
    dlp = resolve(team.dlp, rule.dlp)
    assert dlp is not None and (dlp.action, dlp.detectors) == ("report", ("github", "aws"))
    assert [a.detector for a in dlp.allow] == ["pypi"]
    off = next(r for r in team.rules if r.host == "off.test")
    assert resolve(team.dlp, off.dlp) is None
    assert "dlp: false" in off.describe() and "dlp: report" in rule.describe()


@pytest.mark.parametrize(("text", "problem"), [
    ("dlp: {action: block}\negress: []\n",
     "p/b.yaml:3: dlp.action must be one of refuse, redact, report"),
    ("egress:\n  - host: db.test\n    protocol: tcp\n    ports: [5432]\n    dlp: true\n",
     "p/b.yaml:5: protocol: tcp cannot be combined with dlp"),
    ("egress:\n  - host: a.test\n    dlp: {detectors: [gihtub]}\n",
     "p/b.yaml:5: dlp.detectors: unknown detector 'gihtub'"),
])
def test_problems_are_told_with_the_line(text: str, problem: str) -> None:
    with pytest.raises(PolicyError) as raised:
        load_policy_texts({"p/b.yaml": "version: v1\nname: b\n" + text})
    assert any(e.startswith(problem) for e in raised.value.errors), raised.value.errors


def test_a_set_without_dlp_does_not_use_it() -> None:
    plain = load_policy_texts({"p/c.yaml": "version: v1\nname: c\negress:\n"
                                           "  - host: a.test\n    dlp: false\n"})
    assert not plain.uses_dlp
