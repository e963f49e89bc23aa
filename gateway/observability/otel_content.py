"""The content a policy opted into (`telemetry: {content: true}`), as span attributes:
the GenAI conventions' input and output messages of an inference call, the request's and
answer's content otherwise, and each MCP `tools/call`'s arguments and result for its
child span. The content arrives beside the audit line, already redacted by the worker."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["content_attributes", "tool_calls"]

_ENCODE = json.JSONEncoder(separators=(",", ":"), default=str).encode
# by the conventions' names on an inference call, the gateway's own otherwise
_CONTENT = {"input": "gen_ai.input.messages", "output": "gen_ai.output.messages"}
_OTHER_CONTENT = {"input": "sandbox_gateway.request.content",
                  "output": "sandbox_gateway.response.content"}


def content_attributes(content: Mapping[str, Any], op: str | None) -> dict[str, str]:
    """The exchange's content attributes (as the worker redacted them): the GenAI
    conventions' input and output messages on an inference call, else the request's and
    answer's content."""
    names = _CONTENT if op is not None else _OTHER_CONTENT
    return {name: content[key] for key, name in names.items()
            if isinstance(content.get(key), str)}


def _messages(text: Any) -> list[Any]:
    """JSON-RPC messages in a body: one object, a batch, or SSE ``data:`` lines."""
    if not isinstance(text, str):
        return []
    try:
        docs = [json.loads(text)]
    except ValueError:
        docs = []
        for row in text.splitlines():
            if row.startswith("data:"):
                try:
                    docs.append(json.loads(row[5:]))
                except ValueError:
                    continue
    out: list[Any] = []
    for doc in docs:
        out.extend(doc if isinstance(doc, list) else [doc])
    return [m for m in out if isinstance(m, dict)]


def tool_calls(content: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """Each ``tools/call`` of the request's content by tool name: its arguments and the
    answer's result (or error) of the same id, as JSON text."""
    found: dict[str, dict[str, str]] = {}
    ids: dict[str, str] = {}
    for message in _messages(content.get("input")):
        params = message.get("params")
        if message.get("method") == "tools/call" and isinstance(params, dict) and \
                isinstance(params.get("name"), str) and params["name"] not in found:
            found[params["name"]] = {"gen_ai.tool.call.arguments": _ENCODE(
                params.get("arguments"))}
            ids[json.dumps(message.get("id"))] = params["name"]
    for message in _messages(content.get("output")):
        name = ids.get(json.dumps(message.get("id")))
        if name is not None:
            answer = message.get("result", message.get("error"))
            found[name]["gen_ai.tool.call.result"] = _ENCODE(answer)
    return found
