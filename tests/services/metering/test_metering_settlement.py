"""Settlement (gateway/services/metering/settlement.py): a reservation settles to what the
call used, or to itself when the usage never arrives, or to nothing when the provider
refused the call."""

from __future__ import annotations

import json

from helpers.metering_step import AZURE, NOW, admit

from gateway.core.policy import PolicySet
from gateway.services.metering import Exchange, Metering
from gateway.services.metering.budgets import BudgetExceeded


def test_reservation_settles_to_usage_or_to_itself(metering: Metering,
                                                   policies: PolicySet) -> None:
    """3. A burst cannot overshoot; a stream cut before its usage counts its
    reservation; a provider error counts nothing; a request never sent counts nothing."""
    body = {"model": "m", "messages": [], "max_tokens": 2000}
    reserved = 2000 + len(json.dumps(body).encode())  # (its output limit and its bytes)
    steps = []
    for _ in range(6):
        steps.append(admit(metering, policies, AZURE, "POST", "/openai/v1/chat/completions",
                           body))
    admitted = [s for s in steps if isinstance(s, Exchange)]
    assert len(admitted) == 10000 // reserved == 4
    assert all(isinstance(s, BudgetExceeded) and s.retry_after == 5 for s in steps[4:])
    usage = (b'{"model": "m", "usage": {"prompt_tokens": 10, "completion_tokens": 90}}')
    first, second, third, fourth = admitted
    first.feed(usage)
    done = metering.complete(first, 200, NOW)
    assert (done.reserved, done.charged, done.basis) == (reserved, 100, "usage")
    second.feed(b'data: {"choices": []}\n\n')  # cut off before its usage chunk
    done = metering.complete(second, 200, NOW)
    assert (done.charged, done.basis) == (reserved, "reservation")
    third.feed(b'{"error": {"message": "bad"}}')
    assert metering.complete(third, 400, NOW).charged == 0
    assert metering.complete(fourth, 0, NOW, sent=False).charged == 0
    book = metering.budgets
    policy = policies.policies["agent"]
    assert book.check("sb", policy, "azure", NOW) is None
    used, held = book._used(book._table("agent", policy.budgets[0], 1794960000.0), "sb")
    assert (used["tokens"], held["tokens"]) == (100 + reserved, 0)
