"""`dlp_plans`: a rule's detection made once per pair of `dlp:` sections, as the resolved
section says (the rule's over its policy's), and refused where there are no detectors."""

from __future__ import annotations

import pytest

from gateway.core.dlp import DEFAULT, Dlp, Scanner
from gateway.core.refusal import Refusal
from gateway.pipeline import dlp_plans
from gateway.pipeline.dlp_plans import Plan, Plans
from gateway.services.dlp.library import build

SCANNER = Scanner(build(DEFAULT), b"test-salt")


class Built:
    """The gateway's detectors (`ports.Detectors`), counting the builds asked for."""

    def __init__(self) -> None:
        self.asked = 0

    def scanner(self) -> Scanner:
        self.asked += 1
        return SCANNER


OFF = Dlp(enabled=False)


@pytest.mark.parametrize(("policy", "rule", "report", "expected"), [
    (None, None, False, None),
    (Dlp(), None, False, ("refuse", DEFAULT, False)),
    (Dlp(action="redact"), None, False, ("redact", DEFAULT, False)),
    (Dlp(action="redact"), None, True, ("report", DEFAULT, False)),  # (mode: report)
    (None, Dlp(detectors=("github",)), False, ("refuse", ("github",), False)),
    (Dlp(action="report", detectors=("aws",)), Dlp(action="refuse"), False,
     ("refuse", ("aws",), False)),
    (Dlp(answers=True), None, False, ("refuse", DEFAULT, True)),
    (Dlp(action="redact"), OFF, False, None),  # (`dlp: false` on the rule)
    (OFF, None, False, None),
])
def test_a_plan_applies_the_rules_section_over_its_policys(
        policy: Dlp | None, rule: Dlp | None, report: bool,
        expected: tuple[str, tuple[str, ...], bool] | None) -> None:
    plan = Plans().of(policy, rule, report, Built(), "p.yaml:3")
    if expected is None:
        assert plan is None
        return
    assert plan is not None
    action, detectors, answers = expected
    assert (plan.action, plan.answers) == (action, answers)
    assert plan.scanner.selection == frozenset(detectors)
    assert plan.gate is plan.scanner.prefilter.gate


def test_a_plan_is_made_once_per_pair_of_sections() -> None:
    plans, built = Plans(), Built()
    policy, rule = Dlp(), Dlp(detectors=("github",))
    first = plans.of(policy, rule, False, built)
    assert plans.of(policy, rule, False, built) is first and built.asked == 1
    assert plans.of(policy, rule, True, built) is not first  # (mode: report: its own)
    reloaded = Dlp(detectors=("github",))  # (a policy reloaded: new sections)
    assert plans.of(policy, reloaded, False, built) is not first
    assert plans.of(None, None, False, built) is None and built.asked == 3


def test_detection_without_detectors_is_refused_every_time() -> None:
    """Fail closed: a rule asking for detection on a gateway without detectors is
    refused (naming the rule), and the refusal is not remembered as "no detection"."""
    plans = Plans()
    for _ in range(2):
        with pytest.raises(Refusal) as refused:
            plans.of(Dlp(), None, False, None, "p.yaml:7")
        assert refused.value.code == "gateway_error" and refused.value.rule == "p.yaml:7"
        assert "no detectors" in str(refused.value)
    assert plans.of(None, None, False, None) is None  # (no detection asked: nothing)
    assert isinstance(plans.of(Dlp(), None, False, Built()), Plan)


def test_the_plans_remembered_are_bounded() -> None:
    plans, built = Plans(), Built()
    sections = [Dlp() for _ in range(3 * dlp_plans._KNOWN)]
    for section in sections:
        assert plans.of(section, None, False, built) is not None
        assert len(plans._known) <= dlp_plans._KNOWN
