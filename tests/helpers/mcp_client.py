"""The official MCP SDK's client, configured by the environment only (HTTPS_PROXY and
SSL_CERT_FILE from `sandbox-gateway env`): runs a list of steps and prints one JSON result.

    python mcp_client.py URL [streamable|sse]   (the steps as JSON on stdin)

Steps: {"list_tools": true} (or "descriptions": each tool's too), {"call": NAME,
"arguments": {...}}, {"read": URI},
{"prompt": NAME, "arguments": {...}}. A step's result is what the session returned, or
{"error": <the error's text>} (a refusal the gateway answered as JSON-RPC arrives so).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from mcp import ClientSession
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamablehttp_client


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


async def main() -> None:
    url = sys.argv[1]
    transport = sys.argv[2] if len(sys.argv) > 2 else "streamable"
    steps = json.load(sys.stdin)
    if transport == "sse":
        async with sse_client(url) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            results = await _steps(session, steps)
    else:
        async with streamablehttp_client(url) as (read, write, _), \
                ClientSession(read, write) as session:
            await session.initialize()
            results = await _steps(session, steps)
    print(json.dumps(results))


asyncio.run(main())
