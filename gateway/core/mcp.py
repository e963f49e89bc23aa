"""MCP calls on a rule with `mcp:`: read the JSON-RPC a sandbox sends, decide each call, and
answer a refusal in the protocol's own shape (pure, no I/O).

Every request on such a rule is decided, whatever its transport: a POST's body, each
message of a WebSocket (`Exchange.ws_message`), a GET (the server's event stream) and a
DELETE (the session's end) pass; any other method is refused (`method_refusal`).

A body (or a WebSocket message) must be one JSON-RPC 2.0 message or a non-empty batch
of them: requests and notifications (`method`), or responses to the server's own
requests (`result`/`error`, no `method`: sampling, elicitation, roots). It is read by the
one strict reader (`core/strictjson.py`): a key repeated at any depth, two keys that
differ only in case, a member the gateway reads spelled in another case (`"METHOD"`,
`"Name"`), bytes that are not UTF-8, a lone surrogate, NaN, an integer past 2^53 or data
after the document is refused, so a server reading keys its own way (the first copy, or
without regard to case) reads what the gateway decided. Anything else is refused.
Per method:

* `initialize`, `ping`, `notifications/*` and every `*/list`: allowed;
* `tools/call`: by `params.name` (the rule's `mcp.tools`), then its `mcp.arguments`;
* `resources/read`, `resources/subscribe`, `resources/unsubscribe`: by `params.uri`
  (read as the server reads it, matched by segment: `McpRule.resource_refusal`);
* `prompts/get`: by `params.name`;
* any other method: refused (the rule does not say it may).

Answers are read as strictly (`core/mcp_answers.py`): every answer listing tools lists
only the tools the rule allows (`ListFilter`); a tool whose description or input schema
changed since the session first saw it is flagged, and with `pin_descriptions` hidden
and its calls refused. The server's own requests (sampling, elicitation, roots) reach
the client only under `mcp.server_requests: allow`; refused, the client sees a ping in
their place, and its answer to it becomes the refusal on the way to the server
(`answer_asks`).
With `pin_descriptions` every listing is checked against the tools' pins in the
state store instead (`Pinned`, `core/mcp_pins.py`): a changed tool is quarantined, left
out of the list and its calls refused (`mcp_tool_changed`) until a person approves.

The older HTTP+SSE transport's client reads every answer on its GET event stream and only
checks that a POST was accepted, so an error answered on the POST never reaches it. There
a refused request goes on as a `ping` under an id that names it (`relay`): nothing of the
call reaches the server, whose answer arrives where the client looks and is rewritten
into the refusal on the way (`relayed_answer`, the same for any answer carrying such an
id).

A batch with one refused call is refused whole (nothing of it reaches the server), each
request answered with an error. The answer is JSON-RPC: `{"jsonrpc": "2.0", "id": <the
request's>, "error": {"code": -32001, "message": "<code>: <reason> (...)", "data": {...}}}`
at the refusal's HTTP status, which the MCP SDK's client surfaces as the call's error.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.core import strictjson
from gateway.core.metering import MODEL_BODY_LIMIT
from gateway.core.policy.mcp_rule import McpRule
from gateway.core.refusal import Refusal, rpc_error

__all__ = ["MAX_AUDITED", "MAX_BODY", "METHODS", "RELAYED", "Call", "Key", "ListFilter",
           "Pinned", "Session", "Sessions", "Unreadable", "answer_asks", "body_refusal",
           "calls", "calls_body", "exact", "fingerprint", "judge", "key", "method_refusal", "read",
           "refusal_reason", "relay", "relayed_answer", "request_body", "valid_id"]

MAX_BODY = MODEL_BODY_LIMIT  # the exchange's whole-body hold (BODY_HOLD_LIMIT)
MAX_AUDITED = 20  # calls of a batch named on its audit line
METHODS = ("POST", "GET", "DELETE")  # the transports': calls, the event stream, the end
_PASS = ("initialize", "ping")
_BY_URI = ("resources/read", "resources/subscribe", "resources/unsubscribe")
# Members the gateway reads: in the objects it reads them from (a message, its params,
# a result, a listed tool) they must be spelled exactly so.
_MEMBERS = frozenset(("jsonrpc", "id", "method", "params", "result", "error", "name",
                      "arguments", "uri", "tools", "description", "inputSchema"))
_FOLDED = {member.casefold(): member for member in _MEMBERS}

Key = tuple[str, Any]  # a JSON-RPC id compared by type and value ("102" is not 102)


class Unreadable(Exception):
    """The body is not JSON-RPC as MCP sends it; the message says what is wrong."""


def key(ident: Any) -> Key:
    """`ident` as JSON-RPC compares ids: by type and value (1 is neither "1" nor 1.0)."""
    return type(ident).__name__, ident


def valid_id(ident: Any) -> bool:
    """A request's id as MCP sends it: a string or an integer."""
    return isinstance(ident, str | int) and not isinstance(ident, bool)


def read(body: bytes) -> tuple[list[Any], bool]:
    """The messages of a body (or WebSocket message) read strictly (`core/strictjson.py`,
    keys also refused when they differ only in case), and whether it was a batch.
    Raises Unreadable."""
    try:
        doc = strictjson.loads(body, fold=True)
    except strictjson.StrictJsonError as exc:
        raise Unreadable(f"the body is not strict JSON: {exc}") from None
    batch = isinstance(doc, list)
    messages = doc if batch else [doc]
    if not messages:
        raise Unreadable("an empty batch")
    return messages, batch


def exact(obj: dict[str, Any]) -> None:
    """A member the gateway reads, in an object it reads it from, spelled only exactly:
    `"Method"` or `"NAME"` is refused (a server matching names without regard to case
    would read it where the gateway reads nothing). Raises Unreadable."""
    for name in obj:
        member = _FOLDED.get(name.casefold())
        if member is not None and member != name:
            raise Unreadable(f"a member {member!r} spelled in another case (a server "
                             "matching names without regard to case would read it)")


def body_refusal(method: str, body: bytes | None) -> str | None:
    """Why a request that is no POST is refused for its body, or None: only a POST's body
    is read (as calls), and a server reading another's would act on what the gateway
    never decided."""
    if method == "POST" or not body:
        return None
    return (f"a {method[:16]} with a body on a rule with mcp: (only a POST's body is read "
            "as JSON-RPC calls; send calls as a POST)")


def method_refusal(method: str) -> str | None:
    """Why an HTTP method is refused on a rule with mcp:, or None (`METHODS`)."""
    if method in METHODS:
        return None
    return (f"method {method[:16]!r} is not one of an MCP transport (POST for calls, GET "
            "for the server's event stream or a WebSocket, DELETE to end a session), so "
            "the rule's mcp: cannot decide it; give what is not MCP on this host its own "
            "rule (paths:)")


@dataclass(frozen=True, slots=True)
class Call:
    """One message of the body: `method` None for a response to the server; `name` the
    tool, resource URI or prompt it names; `id` the request's (None: a notification or
    a response); `refused` why it may not go, or None, and with which `code`."""

    method: str | None
    name: str | None
    id: Any
    refused: str | None
    code: str = "mcp_denied"

    @property
    def is_request(self) -> bool:
        return self.method is not None and self.id is not None

    def record(self) -> dict[str, Any]:
        """What the audit line says of it."""
        return {"method": self.method, "name": None if self.name is None else self.name[:200],
                "decision": "deny" if self.refused else "allow"}


def calls(rule: McpRule, body: bytes, changed: Container[str] = frozenset()
          ) -> tuple[list[Call], bool]:
    """The calls in `body` with their decisions, and whether it was a batch; `changed`:
    the tools quarantined (their description changed: refused with `pin_descriptions`).
    Raises Unreadable."""
    messages, batch = read(body)
    pinned = changed if rule.pin_descriptions else frozenset()
    return [_call(rule, message, pinned) for message in messages], batch


def _call(rule: McpRule, message: object, pinned: Container[str]) -> Call:
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        raise Unreadable('a message is not a JSON-RPC 2.0 object ("jsonrpc": "2.0")')
    exact(message)
    ident = message.get("id")
    if ident is not None and not valid_id(ident):
        raise Unreadable("a JSON-RPC id must be a string or an integer")
    if "method" not in message:
        if ident is None or ("result" in message) == ("error" in message):
            raise Unreadable("a message has no method and is not a response (id with "
                             "result or error)")
        return Call(None, None, None, None)  # a response to the server's request
    method = message["method"]
    if not isinstance(method, str):
        raise Unreadable("a JSON-RPC method must be a string")
    if "result" in message or "error" in message:
        raise Unreadable("a message with a method and a result or error")
    params = message.get("params")
    if params is not None and not isinstance(params, dict):
        raise Unreadable(f"the params of {method[:64]!r} are not an object")
    params = params or {}
    exact(params)
    if method in _PASS or method.startswith("notifications/") or method.endswith("/list"):
        return Call(method, None, ident, None)
    if method == "tools/call":
        name = _text(params, "name", method)
        refused = rule.tools.refusal("tool", name) or rule.argument_refusal(
            name, params.get("arguments"))
        if refused is None and name in pinned:
            return Call(method, name, ident, f"tool {name[:200]!r} changed its description "
                        "or input schema since it was pinned and is quarantined until a "
                        "person approves the change (mcp.pin_descriptions)",
                        "mcp_tool_changed")
        return Call(method, name, ident, refused)
    if method in _BY_URI:
        uri = _text(params, "uri", method)
        return Call(method, uri, ident, rule.resource_refusal(uri))
    if method == "prompts/get":
        name = _text(params, "name", method)
        return Call(method, name, ident, rule.prompts.refusal("prompt", name))
    return Call(method, None, ident, f"method {method[:64]!r} is not one an mcp rule lets "
                "through (tools/call, resources/read, prompts/get and the lists are)")


def _text(params: dict[str, Any], key: str, method: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise Unreadable(f"{method} without params.{key}")
    return value


def refusal_reason(found: list[Call]) -> str | None:
    """Why the body is refused (its first refused call, and how many more), or None."""
    refused = [c for c in found if c.refused]
    if not refused:
        return None
    first = refused[0].refused
    more = f" (and {len(refused) - 1} more call(s) of the batch)" if len(refused) > 1 else ""
    fix = ("see `sandbox-gateway approvals list`" if refused[0].code == "mcp_tool_changed"
           else "change the rule's mcp: to allow it")
    return f"{first}{more}; {fix}"


def answer_asks(body: bytes, asks: dict[Key, dict[str, Any]]) -> bytes | None:
    """The client's answers to server requests the gateway refused (`asks`: the error
    for each, by id; sent on to the client as pings, `core/mcp_answers.py`) become those
    errors, so the server reads a refusal where it asked; None: nothing to rewrite (or
    a body the judge refuses anyway)."""
    try:
        messages, batch = read(body)
    except Unreadable:
        return None
    changed = False
    for at, message in enumerate(messages):
        if isinstance(message, dict) and "method" not in message and \
                valid_id(message.get("id")):
            error = asks.pop(key(message["id"]), None)
            if error is not None:
                messages[at], changed = error, True
    if not changed:
        return None
    return strictjson.dumps(messages if batch else messages[0])


def judge(rule: McpRule, body: bytes | None, changed: Container[str],
          source: str | None) -> tuple[list[Call], Refusal | None]:
    """The one decision on an MCP body (the proxy's exchanges and `evaluate` call it): its
    calls, and the refusal (answered as JSON-RPC) or None. `body` None: not held whole."""
    if body is None:
        return [], Refusal("mcp_denied", "an MCP request on a rule with mcp: is decided on "
                           f"its whole body, and this one was not held (send it with a "
                           f"Content-Length of at most {MAX_BODY} bytes)", source,
                           rpc=([], False))
    try:
        found, batch = calls(rule, body, changed)
    except Unreadable as exc:
        return [], Refusal("mcp_denied", f"not MCP JSON-RPC: {exc}; on a rule with mcp: "
                           "every POST (and WebSocket message) is a JSON-RPC message or "
                           "batch, read one way only", source, rpc=([], False))
    reason = refusal_reason(found)
    if reason is None:
        return found, None
    code = next(c.code for c in found if c.refused)
    return found, Refusal(code, reason, source,
                          rpc=([c.id for c in found if c.is_request], batch))

_NAMED_BY = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri",
             "resources/subscribe": "uri", "resources/unsubscribe": "uri"}


def request_body(call: str, arguments: object = None) -> bytes:
    """The JSON-RPC request an MCP client sends for ``METHOD[:NAME]`` (``tools/call:
    search``, ``resources/read:repo://org/x``, ``ping``), with a tool's ``arguments``:
    what `policy explain --mcp` and a policy test's ``mcp:`` decide. Raises ValueError."""
    method, _, name = call.partition(":")
    if not method:
        raise ValueError("an MCP call is METHOD[:NAME], e.g. tools/call:search_issues")
    params: dict[str, object] = {}
    key = _NAMED_BY.get(method)
    if key is not None:
        if not name:
            raise ValueError(f"{method} needs what it names: {method}:NAME")
        params[key] = name
    if arguments is not None:
        params["arguments"] = arguments
    return json.dumps({"jsonrpc": "2.0", "id": 1, "method": method,
                       **({"params": params} if params else {})}).encode()


def calls_body(calls: list[tuple[str, str | None]]) -> bytes:
    """The JSON-RPC body a client sent for ``calls`` (``(method, name)``, as an audit
    line's ``mcp`` records them): one request, or a batch; what ``policy diff --replay``
    decides again. A name where the method names none is left out."""
    messages = []
    for ident, (method, name) in enumerate(calls, 1):
        key = _NAMED_BY.get(method)
        params = {key: name} if key is not None and name is not None else {}
        messages.append({"jsonrpc": "2.0", "id": ident, "method": method,
                         **({"params": params} if params else {})})
    return json.dumps(messages if len(messages) > 1 else messages[0]).encode()


# -- answers: tools/list filtered, descriptions pinned ----------------------------------------

SESSIONS = 4096  # MCP sessions whose tools are remembered, per process (oldest forgotten)


class Pinned(Container[str], Protocol):
    """The server's tool pins (`core/mcp_pins.ServerPins`): a tool `in` it is quarantined;
    `shown` decides a listed tool; `endpoint` takes the older transport's POST path."""

    def shown(self, tool: str, listing: dict[str, Any]) -> bool: ...
    def endpoint(self, uri: str) -> None: ...


@dataclass(slots=True)
class Session:
    """What one MCP session was shown: each tool's first fingerprint (description and
    input schema), and the tools whose later listing differed; `refused`: the errors of
    requests relayed as pings whose answers have not come back, by nonce; `asks`: the
    errors for the server's requests the gateway refused (sent on as pings), by id."""

    first: dict[str, str]
    changed: set[str]
    refused: dict[str, dict[str, Any]] = field(default_factory=dict)
    asks: dict[Key, dict[str, Any]] = field(default_factory=dict)


class Sessions:
    """MCP sessions by (sandbox, host, `Mcp-Session-Id`): a bounded, per-process memory
    (the oldest forgotten past `limit`)."""

    def __init__(self, limit: int = SESSIONS) -> None:
        self.limit = limit
        self._sessions: OrderedDict[tuple[str, str, str], Session] = OrderedDict()

    def of(self, sandbox: str, host: str, session_id: str) -> Session:
        key = (sandbox, host, session_id)
        session = self._sessions.get(key)
        if session is None:
            session = self._sessions[key] = Session({}, set())
            while len(self._sessions) > self.limit:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(key)
        return session


RELAYED = "sandbox-gateway-refused:"  # the id prefix of a refused request relayed as a ping
RELAYS = 256  # relayed refusals a session remembers until their answers come back


def relay(session: Session, refusal: Refusal) -> bytes:
    """The body to send instead of a request body `refusal` refused (one with requests),
    for a client that reads answers only on its event stream: a ping for each refused
    request, under the id ``RELAYED<nonce>:<the request's id as JSON>``; the session
    keeps each one's error until `relayed_answer` puts it in place of the ping's answer
    (`core/mcp_answers.py`)."""
    assert refusal.rpc is not None and refusal.rpc[0]
    ids, batch = refusal.rpc
    pings = []
    for ident in ids:
        nonce = secrets.token_hex(8)
        session.refused[nonce] = rpc_error(refusal, ident)
        pings.append({"jsonrpc": "2.0", "id": f"{RELAYED}{nonce}:{json.dumps(ident)}",
                      "method": "ping"})
    while len(session.refused) > RELAYS:
        del session.refused[next(iter(session.refused))]
    return json.dumps(pings if batch else pings[0]).encode()


def relayed_answer(session: Session, marked: str) -> dict[str, Any]:
    """The refusal in place of the answer to a relayed ping: the session's, or (answered
    to another process, or forgotten) one that names no reason, for the request's id."""
    nonce, _, original = marked[len(RELAYED):].partition(":")
    error = session.refused.pop(nonce, None)
    if error is not None:
        return error
    try:
        ident = strictjson.loads(original.encode())
    except ValueError:
        ident = None
    if not valid_id(ident):
        ident = None
    return rpc_error(Refusal("mcp_denied", "the gateway refused this request by the rule's "
                             "mcp: (its audit line says which call and why)", None), ident)


def fingerprint(tool: dict[str, Any]) -> str:
    shown = {"description": tool.get("description"), "inputSchema": tool.get("inputSchema")}
    return hashlib.sha256(json.dumps(shown, sort_keys=True).encode()).hexdigest()


class ListFilter:
    """Lists only the tools the rule allows in a `tools/list` answer (`core/mcp_answers`
    finds the answers); a tool whose description or schema differs from what the session
    was first shown is recorded in `changed` (and, with `pin_descriptions`, left out);
    with `pins`, each tool is checked against its pin in the state store instead (left
    out while quarantined)."""

    def __init__(self, rule: McpRule, session: Session, pins: Pinned | None = None) -> None:
        self.rule, self.session, self.pins = rule, session, pins
        self.changed: list[str] = []
        self.hidden = 0

    def tools(self, tools: list[Any]) -> list[Any]:
        """The tools of one answer the client may see."""
        return self._tools(tools)

    def _tools(self, tools: list[Any]) -> list[Any]:
        kept = []
        for tool in tools:
            name = tool.get("name") if isinstance(tool, dict) else None
            if not isinstance(name, str) or self.rule.tools.refusal("tool", name):
                self.hidden += 1
                continue
            assert isinstance(tool, dict)
            if self.pins is not None:  # (checked against its pin in the state store)
                if not self.pins.shown(name, tool):
                    self.changed.append(name)
                    self.hidden += 1
                    continue
                kept.append(tool)
                continue
            mark = fingerprint(tool)
            if self.session.first.setdefault(name, mark) != mark:
                self.changed.append(name)
                self.session.changed.add(name)
                if self.rule.pin_descriptions:
                    self.hidden += 1
                    continue
            kept.append(tool)
        return kept
