"""The shared polling loop: checks every interval, survives a failing check, stops."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.services.polling import Poller


class Counting(Poller):
    _poll_name = "counting"

    def __init__(self) -> None:
        self.interval = 0.01
        self.calls = 0

    async def check(self) -> bool:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("a broken check")
        return False


def test_polls_survives_a_failing_check_and_stops(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> Counting:
        poller = Counting()
        task = poller._poll()
        assert poller._poll() is task  # started once
        await asyncio.sleep(0.1)
        await poller.stop()
        assert task.done() and poller._task is None
        calls = poller.calls
        await asyncio.sleep(0.05)
        assert poller.calls == calls  # stopped means stopped
        await poller.stop()  # twice is fine
        return poller

    with caplog.at_level(logging.ERROR):
        poller = asyncio.run(scenario())
    assert poller.calls >= 3  # went on after the failure
    assert "counting: check failed" in caplog.text
