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
        skipping = Hooks(master.addons, skip=(AsyncRecorder,))
        calls.clear()
        await skipping("requestheaders", object())
        assert "b:async" not in calls and "a:requestheaders" in calls

    asyncio.run(run())


@pytest.mark.parametrize("head", [
    [b"GET /a?b=c HTTP/1.1", b"Host: x.test", b"X-Multi: 1", b"X-Multi: 2"],
    [b"POST http://x.test:8080/p HTTP/1.0", b"Content-Length: 3"],
    [b"OPTIONS * HTTP/1.1", b"Host: x.test"],
])
def test_request_head_matches_mitmproxys_parser(head: list[bytes]) -> None:
    from mitmproxy.net.http import http1

    from gateway.intercept import _request_head

    ours, theirs = _request_head(head).get_state(), http1.read_request_head(head).get_state()
    for state in (ours, theirs):
        state.pop("timestamp_start")
    assert ours == theirs


def test_response_head_matches_mitmproxys_parser() -> None:
    from mitmproxy.net.http import http1

    from gateway.intercept import _response_head

    head = [b"HTTP/1.1 404 Not Found", b"Content-Length: 0", b"Set-Cookie: a", b"Set-Cookie: b"]
    ours, theirs = _response_head(head).get_state(), http1.read_response_head(head).get_state()
    for state in (ours, theirs):
        state.pop("timestamp_start")
    assert ours == theirs
    with pytest.raises(ValueError):
        _response_head([b"HTTP/1.1 abc", b""])
