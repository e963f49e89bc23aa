"""What the metering step refuses, rendered as the one refusal every engine answers
(core/metering/refusals.py), table-driven."""

from __future__ import annotations

import pytest

from gateway.core.metering.models import ModelRefusal
from gateway.core.metering.refusals import (
    RETRY_AFTER_MAX,
    STEP_REFUSALS,
    BudgetExceeded,
    MeteringRefusal,
    refusal,
)
from gateway.core.policy.model import Budget

DAY = Budget(name="daily", per="sandbox", window=86400, window_text="1d", tokens=1000,
             source="p.yaml:9")


def _exceeded(frees_in: int, asked: float = 0, used: float = 1000) -> BudgetExceeded:
    return BudgetExceeded(DAY, "s1", "tokens", used, 1000, 0.0, 86400.0, frees_in,
                          asked=asked)


CASES = [
    ("a model", ModelRefusal("model x is not allowed", "x", "p.yaml:3"),
     ("model_not_allowed", 403, "p.yaml:3", None, None)),
    ("metering unavailable", MeteringRefusal("metering_unavailable", "why", "p.yaml:4"),
     ("metering_unavailable", 403, "p.yaml:4", None, None)),
    ("a budget with room soon", _exceeded(60),
     ("budget_exceeded", 429, "p.yaml:9", 60, 60)),
    ("a budget with room only past the cap", _exceeded(RETRY_AFTER_MAX + 1),
     ("budget_exceeded", 429, "p.yaml:9", None, RETRY_AFTER_MAX + 1)),
]


@pytest.mark.parametrize(("what", "step", "expected"), CASES, ids=[c[0] for c in CASES])
def test_refusal(what: str, step: object, expected: tuple[object, ...]) -> None:
    assert isinstance(step, STEP_REFUSALS)
    got = refusal(step)
    assert (got.code, step.status, got.rule, got.retry_after, got.resets_in) == expected


def test_a_budget_reason_says_what_to_change() -> None:
    used_up = _exceeded(60).reason
    assert 'budget "daily" (p.yaml:9) is used up for sandbox "s1"' in used_up
    assert "1,000 tokens used of 1,000 tokens" in used_up and "retry then" in used_up
    too_big = _exceeded(60, asked=900, used=500).reason
    assert "has 500 tokens left" in too_big and "up to 900 tokens" in too_big
    assert "lower max_tokens" in too_big
