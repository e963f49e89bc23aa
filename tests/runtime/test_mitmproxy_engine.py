"""mitmproxy started on demand: built once however many connections wait for it, each
handed to its listener's `handle_stream`; when it cannot start, every waiting connection
is closed and given back to the gateway (audited there), and the failure is not retried
per connection. (The real engine runs in the integration suite: every HTTP/2 parity row.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.runtime.mitmproxy_engine import MitmproxyEngine


class _Server:
    def __init__(self, mode: str) -> None:
        self.mode = type("Mode", (), {"type_name": mode})()
        self.is_running = False
        self.streams: list[Any] = []

    async def handle_stream(self, reader: Any, writer: Any) -> None:
        self.streams.append(writer)


class _Master:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.servers = [_Server("regular"), _Server("transparent")]
        self.addons = self
        self.stopped = False

    def get(self, name: str) -> Any:
        assert name == "proxyserver"
        return self

    async def run(self) -> None:
        await asyncio.sleep(0.01)
        if self.fail:
            raise OSError("no such thing")
        for server in self.servers:
            server.is_running = True
        await asyncio.sleep(3600)

    def shutdown(self) -> None:
        self.stopped = True


class _Writer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.closed = False

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", self.port) if name == "peername" else None

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("fail", [False, True])
def test_built_once_and_each_connection_handed_or_closed(fail: bool) -> None:
    built: list[_Master] = []
    abandoned: list[tuple[str, int]] = []

    def build() -> Any:
        built.append(_Master(fail))
        return built[-1]

    async def main() -> None:
        engine = MitmproxyEngine(build, abandoned=abandoned.append)
        assert not engine.started
        writers = [_Writer(port) for port in (1001, 1002, 1003)]
        await asyncio.gather(engine.handoff("regular")(None, writers[0]),  # type: ignore[arg-type]
                             engine.handoff("regular")(None, writers[1]),  # type: ignore[arg-type]
                             engine.handoff("transparent")(None, writers[2]))  # type: ignore[arg-type]
        assert len(built) == 1 and engine.started
        master = built[0]
        if fail:
            assert all(w.closed for w in writers)
            assert abandoned == [("127.0.0.1", 1001), ("127.0.0.1", 1002), ("127.0.0.1", 1003)]
            late = _Writer(1004)  # (a later connection: refused without a second build)
            await engine.handoff("regular")(None, late)  # type: ignore[arg-type]
            assert late.closed and len(built) == 1
        else:
            assert master.servers[0].streams == writers[:2]
            assert master.servers[1].streams == writers[2:]
            assert not abandoned and not any(w.closed for w in writers)
        engine.shutdown()
        assert master.stopped
        if engine.task is not None:
            engine.task.cancel()
            await asyncio.gather(engine.task, return_exceptions=True)

    asyncio.run(main())
