"""MCP calls on a rule with `mcp:`: read the JSON-RPC a sandbox sends, decide each call, and
answer a refusal in the protocol's own shape (pure, no I/O).

A POST body on such a rule must be one JSON-RPC 2.0 message or a non-empty batch of them:
requests and notifications (`method`), or responses to the server's own requests
(`result`/`error`, no `method`: sampling, elicitation, roots). Anything else is refused.
Per method:

* `initialize`, `ping`, `notifications/*` and every `*/list`: allowed;
* `tools/call`: by `params.name` (the rule's `mcp.tools`), then its `mcp.arguments`;
* `resources/read`, `resources/subscribe`, `resources/unsubscribe`: by `params.uri`
  (read as the server reads it, matched by segment: `McpRule.resource_refusal`);
* `prompts/get`: by `params.name`;
* any other method: refused (the rule does not say it may).

Answers to `tools/list` list only the tools the rule allows (`ListFilter`, JSON or SSE);
a tool whose description or input schema changed since the session first saw it is
flagged. With `pin_descriptions` every listing is checked against the tools' pins in the
state store instead (`Pinned`, `core/mcp_pins.py`): a changed tool is quarantined, left
out of the list and its calls refused (`mcp_tool_changed`) until a person approves.

The older HTTP+SSE transport's client reads every answer on its GET event stream and only
checks that a POST was accepted, so an error answered on the POST never reaches it. There
a refused request goes on as a `ping` under an id that names it (`relay`): nothing of the
call reaches the server, whose answer arrives where the client looks and is rewritten
into the refusal on the way (`ListFilter`, the same for any answer carrying such an id).

A batch with one refused call is refused whole (nothing of it reaches the server), each
request answered with an error. The answer is JSON-RPC: `{"jsonrpc": "2.0", "id": <the
request's>, "error": {"code": -32001, "message": "<code>: <reason> (...)", "data": {...}}}`
at the refusal's HTTP status, which the MCP SDK's client surfaces as the call's error.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.core.refusal import Refusal, rpc_error
from gateway.services.metering import MODEL_BODY_LIMIT
from gateway.services.policy.mcp_rule import McpRule

__all__ = ["MAX_AUDITED", "MAX_BODY", "RELAYED", "Call", "ListFilter", "Pinned", "Session",
           "Sessions", "Unfilterable", "Unreadable", "calls", "fingerprint", "judge",
           "refusal_reason", "relay", "request_body"]

MAX_BODY = MODEL_BODY_LIMIT  # the exchange's whole-body hold (BODY_HOLD_LIMIT)
MAX_AUDITED = 20  # calls of a batch named on its audit line
_PASS = ("initialize", "ping")
_BY_URI = ("resources/read", "resources/subscribe", "resources/unsubscribe")


class Unreadable(Exception):
    """The body is not JSON-RPC as MCP sends it; the message says what is wrong."""


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
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise Unreadable("the body is not JSON") from None
    batch = isinstance(doc, list)
    messages = doc if batch else [doc]
    if not messages:
        raise Unreadable("an empty batch")
    pinned = changed if rule.pin_descriptions else frozenset()
    return [_call(rule, message, pinned) for message in messages], batch


def _call(rule: McpRule, message: object, pinned: Container[str]) -> Call:
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        raise Unreadable('a message is not a JSON-RPC 2.0 object ("jsonrpc": "2.0")')
    ident = message.get("id")
    if ident is not None and (isinstance(ident, bool) or not isinstance(ident, str | int)):
        raise Unreadable("a JSON-RPC id must be a string or a number")
    method = message.get("method")
    if method is None:
        if ident is None or ("result" in message) == ("error" in message):
            raise Unreadable("a message has no method and is not a response (id with "
                             "result or error)")
        return Call(None, None, None, None)  # a response to the server's request
    if not isinstance(method, str):
        raise Unreadable("a JSON-RPC method must be a string")
    params = message.get("params")
    if params is not None and not isinstance(params, dict):
        raise Unreadable(f"the params of {method[:64]!r} are not an object")
    params = params or {}
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
                           "every POST is a JSON-RPC message or batch", source,
                           rpc=([], False))
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


# -- answers: tools/list filtered, descriptions pinned ----------------------------------------

MAX_HELD = 8 * 1024 * 1024  # a tools/list answer (or one SSE event) is rewritten whole
SESSIONS = 4096  # MCP sessions whose tools are remembered, per process (oldest forgotten)
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


class Unfilterable(Exception):
    """An answer the gateway must rewrite and cannot (too large, not JSON)."""


class Pinned(Container[str], Protocol):
    """The server's tool pins (`core/mcp_pins.ServerPins`): a tool `in` it is quarantined;
    `shown` decides a listed tool; `endpoint` takes the older transport's POST path."""

    def shown(self, tool: str, listing: dict[str, Any]) -> bool: ...
    def endpoint(self, uri: str) -> None: ...


@dataclass(slots=True)
class Session:
    """What one MCP session was shown: each tool's first fingerprint (description and
    input schema), and the tools whose later listing differed; `refused`: the errors of
    requests relayed as pings whose answers have not come back, by nonce."""

    first: dict[str, str]
    changed: set[str]
    refused: dict[str, dict[str, Any]] = field(default_factory=dict)


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
    keeps each one's error until `ListFilter` puts it in place of the ping's answer."""
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


def _relayed_answer(session: Session, marked: str) -> dict[str, Any]:
    """The refusal in place of the answer to a relayed ping: the session's, or (answered
    to another process, or forgotten) one that names no reason, for the request's id."""
    nonce, _, original = marked[len(RELAYED):].partition(":")
    error = session.refused.pop(nonce, None)
    if error is not None:
        return error
    try:
        ident = json.loads(original)
    except ValueError:
        ident = None
    if isinstance(ident, bool) or not isinstance(ident, str | int):
        ident = None
    return rpc_error(Refusal("mcp_denied", "the gateway refused this request by the rule's "
                             "mcp: (its audit line says which call and why)", None), ident)


def fingerprint(tool: dict[str, Any]) -> str:
    shown = {"description": tool.get("description"), "inputSchema": tool.get("inputSchema")}
    return hashlib.sha256(json.dumps(shown, sort_keys=True).encode()).hexdigest()


class ListFilter:
    """Rewrites the answers to tools/list requests (`ids`; None: every answer that lists
    tools, on a stream the server sends on its own — the older HTTP+SSE transport's GET
    stream, where answers to POSTed requests arrive) in a response body — one JSON
    message, or a Server-Sent Events stream of them — to list only the tools the rule
    allows; a tool whose description or schema differs from what the session was first
    shown is recorded in `changed` (and, with `pin_descriptions`, left out); with `pins`,
    each tool is checked against its pin instead (left out while quarantined). An answer
    to a relayed refusal (`relay`) becomes that refusal. Everything else passes
    unchanged. Raises Unfilterable."""

    def __init__(self, rule: McpRule, ids: set[Any] | None, sse: bool,
                 session: Session, pins: Pinned | None = None) -> None:
        self.rule, self.ids, self.sse, self.session = rule, ids, sse, session
        self.pins = pins
        self.changed: list[str] = []
        self.hidden = 0
        self._held = b""

    def feed(self, data: bytes) -> bytes:
        self._held += data
        if len(self._held) > MAX_HELD:
            raise Unfilterable(f"a tools/list answer over {MAX_HELD} bytes")
        if not self.sse:
            return b""
        out: list[bytes] = []
        while (found := _EVENT_END.search(self._held)) is not None:
            event, self._held = self._held[:found.start()], self._held[found.end():]
            out.append(self._event(event) + found.group())
        return b"".join(out)

    def end(self) -> bytes:
        held, self._held = self._held, b""
        if not held:
            return b""
        if self.sse:
            return self._event(held)
        rewritten = self._message(held)
        return held if rewritten is None else rewritten

    def _event(self, event: bytes) -> bytes:
        lines = event.splitlines()
        data = [line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:")]
        if not data:
            return event
        if self.pins is not None and (b"event: endpoint" in lines or
                                      b"event:endpoint" in lines):
            self.pins.endpoint(b"".join(data).decode("utf-8", "replace"))  # (where the
            return event  # older transport's calls are POSTed: their pins' server)
        rewritten = self._message(b"\n".join(data))
        if rewritten is None:
            return event
        kept = [line for line in lines if not line.startswith(b"data:")]
        return b"\n".join([*kept, b"data: " + rewritten])

    def _message(self, body: bytes) -> bytes | None:
        """The message(s) with their tool lists filtered; None if nothing was rewritten."""
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            if self.sse:
                return None  # (an event that is not JSON is no answer to rewrite)
            raise Unfilterable("a tools/list answer that is not JSON") from None
        messages = doc if isinstance(doc, list) else [doc]
        changed = False
        for at, message in enumerate(messages):
            if not isinstance(message, dict):
                continue
            ident = message.get("id")
            if isinstance(ident, str) and ident.startswith(RELAYED):
                messages[at] = _relayed_answer(self.session, ident)
                changed = True
            elif self.ids is None or (isinstance(ident, str | int) and ident in self.ids):
                result = message.get("result")
                if isinstance(result, dict) and isinstance(result.get("tools"), list):
                    result["tools"] = self._tools(result["tools"])
                    changed = True
        if not changed:
            return None
        return json.dumps(messages if isinstance(doc, list) else messages[0]).encode()

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
