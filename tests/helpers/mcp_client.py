"""The official MCP SDK's client, configured by the environment only (HTTPS_PROXY and
SSL_CERT_FILE from `sandbox-gateway env`): runs a list of steps and prints one JSON result.

    python mcp_client.py URL [streamable|sse]   (the steps as JSON on stdin)
    python mcp_client.py --serve                (one session a line: see `serve`)

Steps: {"list_tools": true} (or "descriptions": each tool's too), {"call": NAME,
"arguments": {...}}, {"read": URI},
{"prompt": NAME, "arguments": {...}}. A step's result is what the session returned, or
{"error": <the error's text>} (a refusal the gateway answered as JSON-RPC arrives so).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from typing import Any

import httpx
from mcp import ClientSession
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamablehttp_client
from mcp.shared._httpx_utils import create_mcp_http_client


async def _steps(session: ClientSession, steps: list[dict[str, Any]]) -> list[Any]:
    out: list[Any] = []
    for step in steps:
        try:
            if "list_tools" in step:
                tools = await session.list_tools()
                listed: dict[str, Any] = {"tools": sorted(t.name for t in tools.tools)}
                if step["list_tools"] == "descriptions":
                    listed["descriptions"] = {t.name: t.description for t in tools.tools}
                out.append(listed)
            elif "call" in step:
                result = await session.call_tool(step["call"], step.get("arguments") or {})
                out.append({"is_error": result.isError,
                            "text": " ".join(getattr(c, "text", "") for c in result.content)})
            elif "read" in step:
                result = await session.read_resource(step["read"])
                out.append({"text": " ".join(getattr(c, "text", "") for c in result.contents)})
            elif "prompt" in step:
                result = await session.get_prompt(step["prompt"], step.get("arguments") or {})
                out.append({"messages": len(result.messages)})
        except Exception as exc:  # (each step's failure is its result)
            out.append({"error": f"{type(exc).__name__}: {exc}"})
    return out


def _factory(env: dict[str, str] | None) -> Any:
    """The SDK's own httpx client factory, made while `env` (HTTPS_PROXY, SSL_CERT_FILE) is
    the process's environment: httpx reads both as the client is made, so a session of
    `serve` is configured by its environment only, as one process of its own would be."""
    def make(headers: dict[str, str] | None = None, timeout: httpx.Timeout | None = None,
             auth: httpx.Auth | None = None) -> httpx.AsyncClient:
        saved = {k: os.environ.get(k) for k in env or {}}
        os.environ.update(env or {})
        try:  # (synchronous: no other session runs meanwhile)
            return create_mcp_http_client(headers=headers, timeout=timeout, auth=auth)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return make


async def _session(url: str, transport: str, steps: list[dict[str, Any]],
                   env: dict[str, str] | None = None) -> list[Any]:
    factory = _factory(env)
    if transport == "sse":
        async with sse_client(url, httpx_client_factory=factory) as (read, write), \
                ClientSession(read, write) as session:
            await session.initialize()
            return await _steps(session, steps)
    async with streamablehttp_client(url, httpx_client_factory=factory) as (read, write, _), \
            ClientSession(read, write) as session:
        await session.initialize()
        return await _steps(session, steps)


async def serve() -> None:
    """Sessions for a whole test module from one process (its imports take a second or
    more a start): each stdin line `{"id", "url", "transport", "steps", "env"}` runs as
    its own session, at once (they may overlap), answered by one stdout line `{"id",
    "results"}` or `{"id", "error"}`."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    running: set[asyncio.Task[None]] = set()

    async def one(request: dict[str, Any]) -> None:
        try:
            answer = {"id": request["id"], "results": await asyncio.wait_for(_session(
                request["url"], request.get("transport", "streamable"), request["steps"],
                request.get("env")), 90)}
        except BaseException:  # (the session's failure is its answer)
            answer = {"id": request["id"], "error": traceback.format_exc()[-3000:]}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()

    while line := await reader.readline():
        task = loop.create_task(one(json.loads(line)))
        running.add(task)
        task.add_done_callback(running.discard)
    for task in list(running):
        task.cancel()


async def main() -> None:
    if sys.argv[1] == "--serve":
        await serve()
        return
    url = sys.argv[1]
    transport = sys.argv[2] if len(sys.argv) > 2 else "streamable"
    print(json.dumps(await _session(url, transport, json.load(sys.stdin))))


asyncio.run(main())
