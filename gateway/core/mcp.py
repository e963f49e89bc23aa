"""MCP calls on a rule with `mcp:`: read the JSON-RPC a sandbox sends, decide each call, and
answer a refusal in the protocol's own shape (pure, no I/O).

A POST body on such a rule must be one JSON-RPC 2.0 message or a non-empty batch of them:
requests and notifications (`method`), or responses to the server's own requests
(`result`/`error`, no `method`: sampling, elicitation, roots). Anything else is refused.
Per method:

* `initialize`, `ping`, `notifications/*` and every `*/list`: allowed;
* `tools/call`: by `params.name` (the rule's `mcp.tools`), then its `mcp.arguments`;
* `resources/read`, `resources/subscribe`, `resources/unsubscribe`: by `params.uri`;
* `prompts/get`: by `params.name`;
* any other method: refused (the rule does not say it may).

A batch with one refused call is refused whole (nothing of it reaches the server), each
request answered with an error. The answer is JSON-RPC: `{"jsonrpc": "2.0", "id": <the
request's>, "error": {"code": -32001, "message": "<code>: <reason> (...)", "data": {...}}}`
at the refusal's HTTP status, which the MCP SDK's client surfaces as the call's error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.services.policy.mcp_rule import McpRule

__all__ = ["MAX_AUDITED", "REFUSED_CODE", "Call", "Unreadable", "calls", "error_body",
           "refusal_reason"]

REFUSED_CODE = -32001  # JSON-RPC implementation-defined server error: refused by the gateway
MAX_AUDITED = 20  # calls of a batch named on its audit line
_PASS = ("initialize", "ping")
_BY_URI = ("resources/read", "resources/subscribe", "resources/unsubscribe")


class Unreadable(Exception):
    """The body is not JSON-RPC as MCP sends it; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class Call:
    """One message of the body: `method` None for a response to the server; `name` the
    tool, resource URI or prompt it names; `id` the request's (None: a notification or
    a response); `refused` why it may not go, or None."""

    method: str | None
    name: str | None
    id: Any
    refused: str | None

    @property
    def is_request(self) -> bool:
        return self.method is not None and self.id is not None

    def record(self) -> dict[str, Any]:
        """What the audit line says of it."""
        return {"method": self.method, "name": None if self.name is None else self.name[:200],
                "decision": "deny" if self.refused else "allow"}


def calls(rule: McpRule, body: bytes) -> tuple[list[Call], bool]:
    """The calls in `body` with their decisions, and whether it was a batch. Raises
    Unreadable."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise Unreadable("the body is not JSON") from None
    batch = isinstance(doc, list)
    messages = doc if batch else [doc]
    if not messages:
        raise Unreadable("an empty batch")
    return [_call(rule, message) for message in messages], batch


def _call(rule: McpRule, message: object) -> Call:
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
        return Call(method, name, ident, refused)
    if method in _BY_URI:
        uri = _text(params, "uri", method)
        return Call(method, uri, ident, rule.resources.refusal("resource", uri))
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
    return f"{first}{more}; change the rule's mcp: to allow it"


def error_body(message: str, data: dict[str, Any], ids: list[Any], batch: bool) -> bytes:
    """The JSON-RPC error answer: one error per request id (`id` null when there is none
    to answer, e.g. an unreadable body), an array for a batch."""
    errors = [{"jsonrpc": "2.0", "id": ident,
               "error": {"code": REFUSED_CODE, "message": message, "data": data}}
              for ident in (ids or [None])]
    return json.dumps(errors if batch and ids else errors[0]).encode()
