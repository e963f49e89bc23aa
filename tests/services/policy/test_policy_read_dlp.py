"""`dlp:` as policy files write it: what reads, and what is refused with the line and
what to write instead (the reader; the loader composing it: test_policy_loader_dlp.py)."""

from __future__ import annotations

import pytest
import yaml

from gateway.core.dlp import DEFAULT, Dlp, Finding, Location, resolve
from gateway.services.policy.nodes import Nodes
from gateway.services.policy.problems import Problems
from gateway.services.policy.read_dlp import read_dlp


def _read(text: str, *, rule: bool = False) -> tuple[Dlp | None, list[str]]:
    problems = Problems()
    node = yaml.compose(text)
    assert node is not None
    result = read_dlp(Nodes("policies/a.yaml", problems), node, rule=rule)
    return result, [f"{file}:{line}: {message}" for file, line, message in problems.errors]


def _finding(detector: str) -> Finding:
    return Finding(detector, Location("header", "X"), "0" * 16)


@pytest.mark.parametrize(("text", "rule", "action", "detectors", "allowed"), [
    ("{action: refuse}", False, "refuse", None, 0),
    ("{}", False, "refuse", None, 0),
    ("{}", True, None, None, 0),
    ("{action: report, detectors: [aws, github]}", False, "report", ("aws", "github"), 0),
    ("{action: redact, detectors: [default, keyword]}", True, "redact",
     (*DEFAULT, "keyword"), 0),
    ("{allow: [{detector: pypi, hosts: [upload.pypi.org, '*.pypi.io']}]}", True, None, None, 1),
    ("true", False, None, None, 0),
])
def test_what_reads(text: str, rule: bool, action: str | None,
                    detectors: tuple[str, ...] | None, allowed: int) -> None:
    dlp, errors = _read(text, rule=rule)
    assert errors == []
    assert dlp is not None and dlp.enabled
    assert dlp.action == action and dlp.detectors == detectors and len(dlp.allow) == allowed


@pytest.mark.parametrize(("text", "error"), [
    ("[refuse]", "a.yaml:1: dlp must be a mapping"),
    ("{action: block}", "dlp.action must be one of refuse, redact, report, not 'block'"),
    ("{action: redcat}", 'did you mean "redact"?'),
    ("{detectors: [gihtub]}", 'unknown detector \'gihtub\' (did you mean "github"?)'),
    ("{detectors: []}", "dlp.detectors must be a non-empty list"),
    ("{detectors: aws}", "dlp.detectors must be a non-empty list"),
    ("{allow: {detector: pypi}}", "dlp.allow must be a list"),
    ("{allow: [{detector: pypi}]}", "dlp.allow entry needs hosts"),
    ("{allow: [{detector: default, hosts: [a.test]}]}", "unknown detector 'default'"),
    ("{allow: [{detector: pypy, hosts: [a.test]}]}", 'did you mean "pypi"?'),
    ("{allow: [{detector: pypi, hosts: []}]}", "must name at least one host"),
    ("{allow: [{detector: pypi, hosts: ['upload.pypi.org:443']}]}",
     "dlp.allow.hosts: host pattern 'upload.pypi.org:443' contains a port"),
    ("{allow: [{detector: pypi, hosts: [a.test], when: never}]}",
     'unknown key "when" in dlp.allow entry'),
    ("{mode: strict}", 'unknown key "mode" in dlp'),
])
def test_what_is_refused(text: str, error: str) -> None:
    dlp, errors = _read(text)
    assert dlp is None
    assert any(error in e for e in errors), errors


def test_errors_carry_their_line() -> None:
    _, errors = _read("action: refuse\ndetectors:\n  - aws\n  - nope\n")
    assert errors and errors[0].startswith("policies/a.yaml:4: ")


def test_allow_and_the_rule_over_the_policy() -> None:
    policy, _ = _read("{action: refuse, detectors: [default]}")
    rule, _ = _read("{action: report, allow: [{detector: pypi, hosts: [upload.pypi.org]}]}",
                    rule=True)
    off, _ = _read("false", rule=True)
    assert policy is not None and rule is not None and off is not None
    merged = resolve(policy, rule)
    assert merged is not None and merged.effective_action == "report"
    assert not merged.applies(_finding("pypi"), "upload.pypi.org")
    assert merged.applies(_finding("pypi"), "evil.example")
    assert merged.applies(_finding("github"), "upload.pypi.org")
    assert not merged.applies(_finding("keyword"), "x.test")  # opt-in, not selected
    assert resolve(policy, off) is None
    assert resolve(None, None) is None
    only_rule = resolve(None, rule)
    assert only_rule is not None and only_rule.effective_action == "report"
    assert resolve(policy, None) == policy


@pytest.mark.parametrize(("policy_text", "rule_text", "answers"), [
    ("{}", None, False),  # (default: answers are not scanned)
    ("{answers: report}", None, True),
    ("{answers: off}", None, False),
    ("{answers: report}", "{action: report}", True),  # (a rule's section inherits it)
    ("{answers: report}", "{answers: off}", False),  # (and may turn it off)
    ("{}", "{answers: report}", True),
    ("{answers: 'off'}", "{}", False),
])
def test_answers_report_is_read_and_inherited(policy_text: str, rule_text: str | None,
                                              answers: bool) -> None:
    """`answers: report` flags credentials found in answers (never refused); `off`, the
    default, does not scan them. A rule's `answers` overrides its policy's."""
    policy, errors = _read(policy_text)
    rule, rule_errors = _read(rule_text, rule=True) if rule_text else (None, [])
    assert errors == rule_errors == [] and policy is not None
    merged = resolve(policy, rule)
    assert merged is not None and merged.reports_answers is answers


@pytest.mark.parametrize(("text", "error"), [
    ("{answers: refuse}", "dlp.answers must be report or off (answers are never refused"),
    ("{answers: reprot}", 'did you mean "report"?'),
    ("{answers: true}", "dlp.answers must be report or off"),
    ("{answers: [report]}", "dlp.answers must be report or off"),
])
def test_answers_takes_report_or_off(text: str, error: str) -> None:
    dlp, errors = _read(text)
    assert dlp is None
    assert any(error in e for e in errors), errors
