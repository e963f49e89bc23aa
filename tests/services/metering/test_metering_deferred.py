"""Deferred jobs (gateway/services/metering/deferred.py): a background response started
through the gateway is metered once, when its finished result is retrieved through it."""

from __future__ import annotations

from helpers.metering_step import NOW, admit

from gateway.core.policy import PolicySet
from gateway.services.metering import Exchange, Metering


def test_background_jobs_are_metered_once_when_retrieved(metering: Metering,
                                                         policies: PolicySet) -> None:
    """4. On a rule without a budget: the job's id is remembered; its retrieval is
    metered when it carries usage, once; a retrieval of anything else is not."""
    step = admit(metering, policies, "api.openai.com", "POST", "/v1/responses",
                 {"model": "gpt-4o-mini", "background": True})
    assert isinstance(step, Exchange) and step.deferred == "response" and step.meter is None
    step.feed(b'{"id": "resp_bg1", "status": "queued", "usage": null}')
    assert metering.complete(step, 200, NOW).as_record() is None
    pending = admit(metering, policies, "api.openai.com", "GET", "/v1/responses/resp_bg1")
    assert isinstance(pending, Exchange) and pending.retrieval is not None
    pending.feed(b'{"id": "resp_bg1", "status": "in_progress", "usage": null}')
    assert metering.complete(pending, 200, NOW).as_record() is None  # not done yet
    done = admit(metering, policies, "api.openai.com", "GET", "/v1/responses/resp_bg1/")
    assert isinstance(done, Exchange) and done.retrieval is not None
    done.feed(b'{"id": "resp_bg1", "status": "completed", "model": "gpt-4o-mini", '
              b'"usage": {"input_tokens": 12, "output_tokens": 30}}')
    record = metering.complete(done, 200, NOW).as_record()
    assert record is not None and (record["input_tokens"], record["output_tokens"]) == (12, 30)
    again = admit(metering, policies, "api.openai.com", "GET", "/v1/responses/resp_bg1")
    assert isinstance(again, Exchange) and again.retrieval is None and again.meter is None
    other = admit(metering, policies, "api.openai.com", "GET", "/v1/responses/resp_other")
    assert isinstance(other, Exchange) and other.meter is None
