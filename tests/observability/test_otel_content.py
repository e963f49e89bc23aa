"""The content a policy opted into, read as span attributes (`otel_content.py`): messages
on an inference call, the request's and answer's content otherwise, and each MCP tool
call's arguments and result by the id that pairs them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.observability.otel_content import content_attributes, tool_calls


@pytest.mark.parametrize(("content", "op", "expected"), [
    ({"input": "[{\"role\":\"user\"}]", "output": "{}"}, "chat",
     {"gen_ai.input.messages": "[{\"role\":\"user\"}]", "gen_ai.output.messages": "{}"}),
    ({"input": "a body", "output": "an answer"}, None,
     {"sandbox_gateway.request.content": "a body",
      "sandbox_gateway.response.content": "an answer"}),
    ({"input": "only the request"}, None, {"sandbox_gateway.request.content": "only the request"}),
    ({"input": 7, "output": None}, "chat", {}),  # (not text: nothing)
])
def test_content_attributes(content: dict[str, Any], op: str | None,
                            expected: dict[str, str]) -> None:
    assert content_attributes(content, op) == expected


def _call(ident: Any, name: str, arguments: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": ident, "method": "tools/call",
            "params": {"name": name, "arguments": arguments}}


def test_a_call_and_its_result_are_paired_by_id_in_a_batch_and_in_sse() -> None:
    request = json.dumps([_call(1, "search", {"q": "x"}), _call("two", "fetch", {"u": 1}),
                          {"jsonrpc": "2.0", "method": "notifications/initialized"}])
    answer = ("event: message\ndata: " + json.dumps({"id": "two", "error": {"code": -1}})
              + "\n\ndata: " + json.dumps({"id": 1, "result": {"content": []}}) + "\n\n")
    assert tool_calls({"input": request, "output": answer}) == {
        "search": {"gen_ai.tool.call.arguments": '{"q":"x"}',
                   "gen_ai.tool.call.result": '{"content":[]}'},
        "fetch": {"gen_ai.tool.call.arguments": '{"u":1}',
                  "gen_ai.tool.call.result": '{"code":-1}'},
    }


@pytest.mark.parametrize("content", [
    {},  # nothing captured
    {"input": "not json", "output": "data: {broken"},
    {"input": json.dumps({"method": "tools/call", "params": {"name": 3}})},  # no tool name
    {"input": json.dumps({"method": "tools/list", "id": 1}), "output": '{"id": 1}'},
])
def test_what_is_not_a_tool_call_gives_no_span(content: dict[str, Any]) -> None:
    assert tool_calls(content) == {}


def test_an_answer_with_an_id_no_call_had_is_not_attached() -> None:
    request = json.dumps(_call(1, "search", None))
    found = tool_calls({"input": request, "output": json.dumps({"id": 2, "result": 1})})
    assert found == {"search": {"gen_ai.tool.call.arguments": "null"}}
