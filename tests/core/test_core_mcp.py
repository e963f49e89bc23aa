"""MCP calls on a rule with mcp: (gateway/core/mcp.py), table-driven: what each body's calls
are, which are refused and why, and the JSON-RPC answer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.core import mcp
from gateway.core.refusal import RPC_REFUSED, Refusal, answer
from gateway.services.policy.mcp_rule import McpRule, Names

RULE = McpRule(tools=Names(allow=("search_*", "get_issue"), deny=("search_secrets",)),
               resources=Names(allow=("repo://org/*",)), prompts=Names(allow=("review",)),
               arguments={"get_issue": {"repo": "org/*"}})


def _msg(method: str | None, params: dict[str, Any] | None = None, ident: Any = 1
         ) -> dict[str, Any]:
    doc: dict[str, Any] = {"jsonrpc": "2.0"}
    if ident is not None:
        doc["id"] = ident
    if method is not None:
        doc["method"] = method
    if params is not None:
        doc["params"] = params
    return doc


# (case, message, None if allowed else a phrase of the refusal)
CALLS: list[tuple[str, dict[str, Any], str | None]] = [
    ("initialize", _msg("initialize", {"protocolVersion": "2025-06-18"}), None),
    ("ping", _msg("ping"), None),
    ("a notification", _msg("notifications/initialized", ident=None), None),
    ("tools/list", _msg("tools/list"), None),
    ("resources/templates/list", _msg("resources/templates/list"), None),
    ("an allowed tool", _msg("tools/call", {"name": "search_code"}), None),
    ("deny wins over allow", _msg("tools/call", {"name": "search_secrets"}), "denied by"),
    ("a tool not listed", _msg("tools/call", {"name": "rm"}), "not in the rule's"),
    ("an argument that matches", _msg("tools/call", {"name": "get_issue", "arguments":
                                                     {"repo": "org/a"}}), None),
    ("an argument that does not", _msg("tools/call", {"name": "get_issue", "arguments":
                                                      {"repo": "evil/a"}}), "does not match"),
    ("an argument climbing out of its glob", _msg("tools/call", {
        "name": "get_issue", "arguments": {"repo": "org/../evil/secret"}}),
     "(read as 'evil/secret') does not match"),
    ("an argument past its segment", _msg("tools/call", {
        "name": "get_issue", "arguments": {"repo": "org/a/b"}}), "does not match"),
    ("an argument with an encoded '/'", _msg("tools/call", {
        "name": "get_issue", "arguments": {"repo": "org%2f..%2fevil"}}),
     "argument 'repo' = 'org%2f..%2fevil' is refused"),
    ("a constrained argument missing", _msg("tools/call", {"name": "get_issue"}),
     "needs argument"),
    ("a constrained argument not a string", _msg("tools/call", {"name": "get_issue",
                                                                "arguments": {"repo": 7}}),
     "needs argument"),
    ("a resource allowed", _msg("resources/read", {"uri": "repo://org/readme"}), None),
    ("a resource not", _msg("resources/read", {"uri": "file:///etc/passwd"}), "not in"),
    ("a resource climbing out of its glob", _msg("resources/read", {
        "uri": "repo://org/../../vault/key"}), "goes above its root"),
    ("a resource resolved inside", _msg("resources/read", {"uri": "repo://org/a/../b"}),
     None),
    ("a subscription by its URI", _msg("resources/subscribe", {"uri": "secret://x"}),
     "not in"),
    ("a prompt allowed", _msg("prompts/get", {"name": "review"}), None),
    ("a prompt not", _msg("prompts/get", {"name": "jailbreak"}), "not in"),
    ("a method no rule lets through", _msg("sampling/createMessage"), "is not one"),
    ("a response to the server", {"jsonrpc": "2.0", "id": 5, "result": {}}, None),
]


@pytest.mark.parametrize(("case", "message", "refused"), CALLS, ids=[c[0] for c in CALLS])
def test_each_call(case: str, message: dict[str, Any], refused: str | None) -> None:
    found, batch = mcp.calls(RULE, json.dumps(message).encode())
    assert not batch and len(found) == 1
    if refused is None:
        assert found[0].refused is None
    else:
        assert found[0].refused is not None and refused in found[0].refused


UNREADABLE = [
    ("not JSON", b"{"), ("not UTF-8", b"\xff\xfe"), ("an empty batch", b"[]"),
    ("no jsonrpc", b'{"id": 1, "method": "ping"}'),
    ("jsonrpc 1.0", b'{"jsonrpc": "1.0", "id": 1, "method": "ping"}'),
    ("a number", b"7"), ("a batch with a non-object", b'[{"jsonrpc": "2.0", "method": "ping"}, 1]'),
    ("no method and no result", b'{"jsonrpc": "2.0", "id": 1}'),
    ("both result and error", b'{"jsonrpc": "2.0", "id": 1, "result": 1, "error": {}}'),
    ("a method that is not a string", b'{"jsonrpc": "2.0", "id": 1, "method": 5}'),
    ("params that are a list", b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": []}'),
    ("an id that is an object", b'{"jsonrpc": "2.0", "id": {}, "method": "ping"}'),
    ("an id that is a boolean", b'{"jsonrpc": "2.0", "id": true, "method": "ping"}'),
    ("tools/call without a name", b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call"}'),
    ("resources/read without a uri",
     b'{"jsonrpc": "2.0", "id": 1, "method": "resources/read", "params": {"uri": ""}}'),
]


@pytest.mark.parametrize(("case", "body"), UNREADABLE, ids=[c[0] for c in UNREADABLE])
def test_what_is_not_mcp_json_rpc(case: str, body: bytes) -> None:
    with pytest.raises(mcp.Unreadable):
        mcp.calls(RULE, body)


def test_a_batch_is_refused_whole_and_answered_per_request() -> None:
    body = json.dumps([_msg("tools/call", {"name": "search_x"}, 1),
                       _msg("notifications/progress", ident=None),
                       _msg("tools/call", {"name": "rm"}, "b"),
                       _msg("prompts/get", {"name": "nope"}, 3)]).encode()
    found, batch = mcp.calls(RULE, body)
    reason = mcp.refusal_reason(found)
    assert batch and reason is not None and "(and 1 more call(s) of the batch)" in reason
    refusal = Refusal("mcp_denied", reason, "p.yaml:3",
                      rpc=([c.id for c in found if c.is_request], batch))
    got = answer(refusal)
    assert got.status == 200 and got.headers.get("x-sandbox-gateway-error") == "mcp_denied"
    errors = json.loads(got.body)
    assert [e["id"] for e in errors] == [1, "b", 3]
    assert all(e["error"]["code"] == RPC_REFUSED and e["error"]["data"] ==
               {"code": "mcp_denied", "rule": "p.yaml:3"} for e in errors)


def test_an_unreadable_body_is_answered_with_a_null_id_at_403() -> None:
    got = answer(Refusal("mcp_denied", "not MCP JSON-RPC: the body is not JSON", rpc=([], False)))
    assert got.status == 403
    doc = json.loads(got.body)
    assert doc["id"] is None and "not MCP JSON-RPC" in doc["error"]["message"]


def test_audit_records_are_bounded() -> None:
    call = mcp.Call("tools/call", "x" * 1000, 1, None)
    assert call.record() == {"method": "tools/call", "name": "x" * 200, "decision": "allow"}


def _tools(*names: str, description: str = "d") -> list[dict[str, Any]]:
    return [{"name": n, "description": description, "inputSchema": {"type": "object"}}
            for n in names]


def _answer(ident: Any, tools: list[dict[str, Any]]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": ident, "result": {"tools": tools}}


def test_a_json_tools_list_lists_only_allowed_tools() -> None:
    lists = mcp.ListFilter(RULE, {1}, False, mcp.Session({}, set()))
    body = json.dumps(_answer(1, _tools("search_a", "rm", "search_secrets", "get_issue")))
    out = lists.feed(body[:10].encode()) + lists.feed(body[10:].encode()) + lists.end()
    assert [t["name"] for t in json.loads(out)["result"]["tools"]] == ["search_a", "get_issue"]
    assert lists.hidden == 2


@pytest.mark.parametrize("separator", [b"\n\n", b"\r\n\r\n"])
def test_an_sse_stream_is_rewritten_event_by_event(separator: bytes) -> None:
    lists = mcp.ListFilter(RULE, {7}, True, mcp.Session({}, set()))
    other = b"event: message" + separator.replace(b"\n\n", b"\n")[:len(separator) // 2] + \
        b'data: {"jsonrpc": "2.0", "method": "notifications/progress"}'
    answer = b"event: message\ndata: " + json.dumps(_answer(7, _tools("rm", "search_x"))).encode()
    stream = other + separator + answer + separator
    out = b"".join(lists.feed(stream[i:i + 5]) for i in range(0, len(stream), 5)) + lists.end()
    assert out.startswith(other + separator)  # (what is no tools/list answer is untouched)
    data = out[len(other + separator):].strip().split(b"data: ", 1)[1]
    assert [t["name"] for t in json.loads(data)["result"]["tools"]] == ["search_x"]


def test_a_changed_description_is_flagged_and_with_pinning_hidden() -> None:
    session = mcp.Session({}, set())
    pinned = McpRule(tools=Names(allow=("*",)), pin_descriptions=True)
    for rule, hidden in ((RULE, False), (pinned, True)):
        session = mcp.Session({}, set())
        first = mcp.ListFilter(rule, {1}, False, session)
        first.feed(json.dumps(_answer(1, _tools("search_a"))).encode())
        first.end()
        second = mcp.ListFilter(rule, {2}, False, session)
        second.feed(json.dumps(_answer(2, _tools("search_a", description="new!"))).encode())
        listed = json.loads(second.end())["result"]["tools"]
        assert second.changed == ["search_a"] and session.changed == {"search_a"}
        assert (listed == []) is hidden
        found, _ = mcp.calls(rule, json.dumps(_msg("tools/call", {"name": "search_a"})).encode(),
                             session.changed)
        assert (found[0].refused is not None) is hidden


def test_what_cannot_be_filtered_is_refused() -> None:
    lists = mcp.ListFilter(RULE, {1}, False, mcp.Session({}, set()))
    lists.feed(b"not json")
    with pytest.raises(mcp.Unfilterable):
        lists.end()
    big = mcp.ListFilter(RULE, {1}, True, mcp.Session({}, set()))
    with pytest.raises(mcp.Unfilterable):
        big.feed(b"data: " + b"x" * (mcp.MAX_HELD + 1))


def test_sessions_are_bounded() -> None:
    sessions = mcp.Sessions(limit=2)
    a = sessions.of("s", "h", "1")
    sessions.of("s", "h", "2")
    assert sessions.of("s", "h", "1") is a
    sessions.of("s", "h", "3")  # "2" was the oldest
    assert sessions.of("s", "h", "1") is a and sessions.of("s", "h", "2") is not a


def test_a_server_stream_has_every_tools_answer_filtered() -> None:
    """ids None (the older transport's GET stream): any answer that lists tools, whatever
    its id; other events (the endpoint, pings, notifications) pass as they are."""
    lists = mcp.ListFilter(RULE, None, True, mcp.Session({}, set()))
    stream = (b"event: endpoint\r\ndata: /messages/?session_id=abc\r\n\r\n"
              b": ping\r\n\r\n"
              b"event: message\r\ndata: " + json.dumps(_answer(42, _tools("rm", "search_y")))
              .encode() + b"\r\n\r\n")
    out = lists.feed(stream) + lists.end()
    assert out.startswith(b"event: endpoint\r\ndata: /messages/?session_id=abc\r\n\r\n"
                          b": ping\r\n\r\n")
    assert b'"rm"' not in out and b'"search_y"' in out


def _relayed(batch: bool) -> tuple[mcp.Session, Refusal, Any]:
    session = mcp.Session({}, set())
    refusal = Refusal("mcp_denied", "tool 'rm' is not allowed", "p.yaml:3",
                      rpc=([7, "b"] if batch else [7], batch))
    return session, refusal, json.loads(mcp.relay(session, refusal))


def test_a_relayed_refusal_sends_only_pings_under_ids_that_name_the_request() -> None:
    """What the server receives names no tool, no argument, no reason: a ping per
    refused request, its id the prefix, a nonce and the request's own id."""
    _, _, single = _relayed(False)
    assert single["method"] == "ping" and "params" not in single
    assert single["id"].startswith(mcp.RELAYED) and single["id"].endswith(":7")
    session, _, batch = _relayed(True)
    assert [p["method"] for p in batch] == ["ping", "ping"]
    assert batch[1]["id"].endswith(':"b"') and len(session.refused) == 2
    assert "rm" not in json.dumps(batch)


@pytest.mark.parametrize("sse", [False, True])
def test_the_answer_to_a_relayed_ping_becomes_the_refusal(sse: bool) -> None:
    session, refusal, sent = _relayed(True)
    answers = [{"jsonrpc": "2.0", "id": p["id"], "result": {}} for p in sent]
    lists = mcp.ListFilter(RULE, None if sse else set(), sse, session)
    if sse:
        body = b"".join(b"event: message\r\ndata: " + json.dumps(a).encode() + b"\r\n\r\n"
                        for a in answers)
        out = lists.feed(body) + lists.end()
        got = [json.loads(line[6:]) for line in out.splitlines() if line.startswith(b"data:")]
    else:
        got = json.loads(lists.feed(json.dumps(answers).encode()) + lists.end())
    assert [g["id"] for g in got] == [7, "b"]
    assert got == [json.loads(answer(Refusal("mcp_denied", refusal.reason, "p.yaml:3",
                                             rpc=([i], False))).body) for i in (7, "b")]
    assert session.refused == {}  # each forgotten once answered


@pytest.mark.parametrize(("marked", "ident"), [
    (mcp.RELAYED + "0000:12", 12),  # another process relayed it, or it was forgotten
    (mcp.RELAYED + '0000:"x"', "x"),
    (mcp.RELAYED + "0000:{not json", None),
    (mcp.RELAYED + "0000:[1]", None),  # not an id a request can have
    (mcp.RELAYED + "0000:true", None),
])
def test_an_answer_to_an_unknown_relay_is_still_a_refusal(marked: str, ident: Any) -> None:
    lists = mcp.ListFilter(RULE, set(), False, mcp.Session({}, set()))
    got = json.loads(lists.feed(json.dumps({"jsonrpc": "2.0", "id": marked,
                                            "result": {}}).encode()) + lists.end())
    assert got["id"] == ident and got["error"]["data"]["code"] == "mcp_denied"
    assert "audit line" in got["error"]["message"]


def test_relays_are_bounded_per_session() -> None:
    session = mcp.Session({}, set())
    for n in range(mcp.RELAYS + 5):
        mcp.relay(session, Refusal("mcp_denied", "r", None, rpc=([n], False)))
    assert len(session.refused) == mcp.RELAYS


def test_an_id_a_set_cannot_hold_is_passed_by_the_list_filter() -> None:
    lists = mcp.ListFilter(RULE, {1}, False, mcp.Session({}, set()))
    body = json.dumps({"jsonrpc": "2.0", "id": {"x": 1}, "result": {"tools": []}}).encode()
    assert lists.feed(body) + lists.end() == body
