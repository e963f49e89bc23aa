"""The admin listener's uvicorn server (runtime/admin_server.py): woken once a second, not
ten times, with the Date header still refreshed each second, and a stop seen at once
(without uvicorn's fixed 0.1 s pause when no admin connection is open)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from uvicorn import server as uvicorn_server
from uvicorn.config import Config as UvicornConfig

from gateway.runtime.admin_server import AdminServer


async def _app(scope: dict[str, object], receive: object, send: object) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]


async def _date(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    head = (await reader.read()).split(b"\r\n\r\n")[0]
    writer.close()
    await writer.wait_closed()
    [date] = [line for line in head.split(b"\r\n") if line.lower().startswith(b"date:")]
    return date


def test_the_admin_server_ticks_once_a_second_and_stops_at_once() -> None:
    async def main() -> None:
        sock = socket.create_server(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = AdminServer(UvicornConfig(_app, log_level="warning", lifespan="off",
                                            access_log=False))
        ticks = 0
        tick = server.on_tick

        async def counting(counter: int) -> bool:
            nonlocal ticks
            ticks += 1
            return await tick(counter)

        server.on_tick = counting  # type: ignore[method-assign]
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        first = await _date(port)
        await asyncio.sleep(2.2)
        later = await _date(port)
        assert later != first  # the Date header moved on: the tick still runs
        assert 2 <= ticks <= 4, ticks  # about once a second (uvicorn's own: ten a second)
        paused: list[float] = []
        real_sleep = asyncio.sleep

        async def sleep(delay: float, *args: object) -> object:
            paused.append(delay)
            return await real_sleep(delay, *args)

        stopped = time.monotonic()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(uvicorn_server.asyncio, "sleep", sleep)
            server.should_exit = True
            await asyncio.wait_for(task, 5)
        assert time.monotonic() - stopped < 0.5  # not the rest of the second
        assert not paused  # (no admin connection open: not uvicorn's fixed 0.1 s pause)
        sock.close()

    asyncio.run(main())
