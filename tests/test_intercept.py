"""The intercept path's hook dispatch (gateway.intercept.Hooks): the addon chain's
hooks in chain order, sync and async, an exception logged without skipping the rest,
addons added later included. The path itself runs in tests/integration."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from mitmproxy import options
from mitmproxy.master import Master

from gateway.intercept import Hooks


class Recorder:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name = name
        self.calls = calls

    def requestheaders(self, flow: Any) -> None:
        self.calls.append(f"{self.name}:requestheaders")


class AsyncRecorder(Recorder):
    async def requestheaders(self, flow: Any) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        self.calls.append(f"{self.name}:async")


class Crashing:
    def requestheaders(self, flow: Any) -> None:
        raise RuntimeError("boom")


class Parent:
    def __init__(self, calls: list[str]) -> None:
        self.addons = [Recorder("child", calls)]


def test_hooks_run_in_chain_order_and_survive_a_crash(caplog: pytest.LogCaptureFixture
                                                      ) -> None:
    calls: list[str] = []

    async def run() -> None:
        master = Master(options.Options(), event_loop=asyncio.get_running_loop())
        master.addons.add(Recorder("a", calls), Crashing(), AsyncRecorder("b", calls),
                          Parent(calls))
        hooks = Hooks(master.addons)
        with caplog.at_level(logging.ERROR, logger="sandbox_gateway"):
            await hooks("requestheaders", object())
        assert calls == ["a:requestheaders", "b:async", "child:requestheaders"]
        assert "Crashing.requestheaders" in caplog.text
        calls.clear()
        master.addons.add(Recorder("late", calls))
        await hooks("requestheaders", object())
        assert calls[-1] == "late:requestheaders"
        await hooks("response", object())  # no addon has it: nothing happens

    asyncio.run(run())
