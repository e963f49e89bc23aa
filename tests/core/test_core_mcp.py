"""MCP calls on a rule with mcp: (gateway/core/mcp.py), table-driven: what each body's calls
are, which are refused and why, and the JSON-RPC answer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.core import mcp
from gateway.core.policy.mcp_rule import McpRule, Names
from gateway.core.refusal import RPC_REFUSED, Refusal, answer

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


# Issue 40, item 3: a body the gateway and a server could read differently (a server
# keeping the first copy of a key, or matching keys without regard to case as Go's
# encoding/json does, would run the call the gateway read as another) is refused.
_CALL = '"jsonrpc": "2.0", "id": 1, "method": "tools/call"'
AMBIGUOUS = [
    ("a repeated method", f'{{{_CALL}, "method": "ping"}}'.encode()),
    ("a method hidden under a repeated key",
     b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "method": "tools/call", '
     b'"params": {"name": "delete_repo"}}'),
    ("method then METHOD", b'{"jsonrpc": "2.0", "id": 1, "method": "ping", '
                           b'"METHOD": "tools/call", "params": {"name": "delete_repo"}}'),
    ("a method only in another case", b'{"jsonrpc": "2.0", "id": 1, "Method": "tools/call",'
                                      b' "params": {"name": "delete_repo"}, "result": {}}'),
    ("a null method then a real one",
     b'{"jsonrpc": "2.0", "id": 1, "method": null, "method": "tools/call", '
     b'"params": {"name": "delete_repo"}}'),
    ("a null method", b'{"jsonrpc": "2.0", "id": 1, "method": null, "result": {}}'),
    ("a repeated name", f'{{{_CALL}, "params": {{"name": "search_a", "name": "rm"}}}}'
     .encode()),
    ("name plus NAME", f'{{{_CALL}, "params": {{"name": "search_a", "NAME": "rm"}}}}'
     .encode()),
    ("a name folded with a long s", f'{{{_CALL}, "params": {{"name": "search_a", '
                                    f'"argument\u017f": {{}}, "arguments": {{}}}}}}'.encode()),
    ("params in another case", f'{{{_CALL}, "params": {{"name": "search_a"}}, '
                               f'"Params": {{"name": "rm"}}}}'.encode()),
    ("a repeated argument", f'{{{_CALL}, "params": {{"name": "get_issue", "arguments": '
                            f'{{"repo": "org/a", "repo": "evil/a"}}}}}}'.encode()),
    ("an argument in two cases", f'{{{_CALL}, "params": {{"name": "get_issue", '
                                 f'"arguments": {{"repo": "org/a", "REPO": "evil/a"}}}}}}'
     .encode()),
    ("a key repeated deep in the arguments",
     f'{{{_CALL}, "params": {{"name": "search_a", "arguments": {{"q": {{"a": 1, "a": 2}}}}}}}}'
     .encode()),
    ("a repeated id", b'{"jsonrpc": "2.0", "id": 1, "id": 2, "method": "ping"}'),
    ("a repeated jsonrpc", b'{"jsonrpc": "1.0", "jsonrpc": "2.0", "id": 1, "method": "ping"}'),
    ("a method and a result", b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "result": {}}'),
    ("NaN in the arguments", f'{{{_CALL}, "params": {{"name": "search_a", "arguments": '
                             f'{{"n": NaN}}}}}}'.encode()),
    ("Infinity", f'{{{_CALL}, "params": {{"name": "search_a", "arguments": '
                 f'{{"n": -Infinity}}}}}}'.encode()),
    ("a lone surrogate in the name",
     f'{{{_CALL}, "params": {{"name": "search_\\ud800"}}}}'.encode()),
    ("an id past 2^53", b'{"jsonrpc": "2.0", "id": 9007199254740993, "method": "ping"}'),
    ("data after the message", b'{"jsonrpc": "2.0", "id": 1, "method": "ping"} {"x": 1}'),
    ("invalid UTF-8 in a string",
     f'{{{_CALL}, "params": {{"name": "search_'.encode() + b"\xc3(" + b'"}}'),
    ("an encoded surrogate", f'{{{_CALL}, "params": {{"name": "search_'.encode() +
     b"\xed\xa0\x80" + b'"}}'),
    ("a BOM", b"\xef\xbb\xbf" + b'{"jsonrpc": "2.0", "id": 1, "method": "ping"}'),
]


@pytest.mark.parametrize(("case", "body"), UNREADABLE + AMBIGUOUS,
                         ids=[c[0] for c in UNREADABLE + AMBIGUOUS])
def test_what_is_not_mcp_json_rpc(case: str, body: bytes) -> None:
    with pytest.raises(mcp.Unreadable):
        mcp.calls(RULE, body)
    _, refusal = mcp.judge(RULE, body, frozenset(), "p.yaml:3")
    assert refusal is not None and refusal.code == "mcp_denied" and \
        refusal.reason.startswith("not MCP JSON-RPC")


def test_the_same_calls_read_unambiguously_pass() -> None:
    """(the rows above differ from these only by what makes them ambiguous)"""
    for body in (f'{{{_CALL}, "params": {{"name": "search_a", "arguments": '
                 f'{{"n": 1.5, "q": {{"a": 1, "b": 2}}}}}}}}'.encode(),
                 f'{{{_CALL}, "params": {{"name": "search_\\ud83d\\ude00"}}}}'.encode(),
                 b'{"jsonrpc": "2.0", "id": 9007199254740991, "method": "ping"}\r\n'):
        found, _ = mcp.calls(RULE, body)
        assert [c.refused for c in found] == [None], body


@pytest.mark.parametrize(("method", "refused"), [
    ("POST", False), ("GET", False), ("DELETE", False), ("PUT", True), ("PATCH", True),
    ("HEAD", True), ("OPTIONS", True), ("CONNECT", True), ("post", True)])
def test_only_the_transports_methods(method: str, refused: bool) -> None:
    why = mcp.method_refusal(method)
    assert (why is not None) is refused
    if why:
        assert "is not one of an MCP transport" in why


@pytest.mark.parametrize(("method", "body", "refused"), [
    ("POST", b"{}", False), ("GET", b"", False), ("DELETE", None, False),
    ("GET", b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call"}', True),
    ("DELETE", b"x", True)])
def test_only_a_posts_body_is_read(method: str, body: bytes | None, refused: bool) -> None:
    why = mcp.body_refusal(method, body)
    assert (why is not None) is refused
    if why:
        assert "only a POST's body is read" in why


def test_a_clients_answer_to_a_refused_server_request_becomes_the_refusal() -> None:
    error = {"jsonrpc": "2.0", "id": 4, "error": {"code": -32001, "message": "no"}}
    asks = {mcp.key(4): error}
    body = json.dumps([{"jsonrpc": "2.0", "id": 4, "result": {}},
                       {"jsonrpc": "2.0", "id": "4", "result": {}}]).encode()
    out = mcp.answer_asks(body, asks)
    assert out is not None and json.loads(out) == [error, {"jsonrpc": "2.0", "id": "4",
                                                           "result": {}}]
    assert asks == {}  # (answered once)
    assert mcp.answer_asks(body, asks) is None


@pytest.mark.parametrize(("a", "b", "same"), [
    (102, 102, True), (102, "102", False), ("a", "a", True), (1, True, False),
    (1, 1.0, False), (0, False, False)])
def test_ids_compare_by_type_and_value(a: Any, b: Any, same: bool) -> None:
    assert (mcp.key(a) == mcp.key(b)) is same


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


def test_sessions_are_bounded() -> None:
    sessions = mcp.Sessions(limit=2)
    a = sessions.of("s", "h", "1")
    sessions.of("s", "h", "2")
    assert sessions.of("s", "h", "1") is a
    sessions.of("s", "h", "3")  # "2" was the oldest
    assert sessions.of("s", "h", "1") is a and sessions.of("s", "h", "2") is not a


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


def test_relays_are_bounded_per_session() -> None:
    session = mcp.Session({}, set())
    for n in range(mcp.RELAYS + 5):
        mcp.relay(session, Refusal("mcp_denied", "r", None, rpc=([n], False)))
    assert len(session.refused) == mcp.RELAYS
