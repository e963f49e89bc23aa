"""A call's worst case (gateway/services/metering/worst_case.py): the reservation is the
bound of its input and output, and a call without a bound on a budgeted rule is refused
saying what to send or set."""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers.metering_step import AZURE, NOW, UNMETERED_POLICY, admit

from gateway.core.policy import PolicySet
from gateway.services.metering import Exchange, Metering, MeteringRefusal
from gateway.services.policy import load_policy_texts


@pytest.mark.parametrize(("body", "reserved"), [
    # two output limits: the larger one, as the provider may honour it
    ({"model": "gpt-4o-mini", "max_completion_tokens": 1, "max_tokens": 1600}, 1600),
    # numbers in other forms
    ({"model": "gpt-4o-mini", "max_tokens": 1e3}, 1000),
    ({"model": "gpt-4o-mini", "max_tokens": 100, "n": "8"}, 800),
    # no limit: the model's maximum output from the catalogue
    ({"model": "gpt-4o-mini"}, 16384),
])
def test_reservations_are_bounds(metering: Metering, body: dict[str, Any],
                                 reserved: int) -> None:
    policies = load_policy_texts({"agent.yaml": UNMETERED_POLICY})
    policy = policies.policies["agent"]
    raw = json.dumps(body).encode()
    step = metering.admit(sandbox="sb", policy=policy, rule=policy.rules[0], preset="openai",
                          method="POST", path="/v1/chat/completions", body=raw, now=NOW)
    assert isinstance(step, Exchange) and step.hold is not None
    assert step.hold.reserved.tokens == reserved + len(raw)


@pytest.mark.parametrize(("body", "words"), [
    ({"model": "gpt-4o-mini", "max_tokens": True}, "max_tokens is true"),
    ({"model": "gpt-4o-mini", "max_tokens": "lots"}, 'max_tokens is "lots"'),
    ({"model": "gpt-4o-mini", "max_tokens": 5, "n": -1}, "n is negative"),
    ({"model": "m", "messages": []}, "names no output limit"),
    ({"model": "m", "max_tokens": 5, "previous_response_id": "r"}, "context window"),
    ({"model": "gpt-4o-mini", "max_tokens": 5, "tools": [{"type": "web_search"}]},
     "max_tool_calls"),
])
def test_calls_without_a_bound_are_refused(metering: Metering, policies: PolicySet,
                                           body: dict[str, Any], words: str) -> None:
    step = admit(metering, policies, AZURE, "POST", "/openai/v1/responses", body)
    assert isinstance(step, MeteringRefusal) and step.code == "metering_unavailable"
    assert words in step.reason
