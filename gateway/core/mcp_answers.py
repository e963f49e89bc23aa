"""An MCP server's answers on a rule with `mcp:`, read before the client sees them and
passed on only as the gateway read them (pure, no I/O).

A client must not read an answer the gateway did not: a tool list it did not filter, a
description it did not pin. So an answer is read with the same strictness as a call
(`core/strictjson.py`, the members the gateway reads spelled exactly: `mcp.exact`), its
framing by the WHATWG event-stream rules (`core/sse.py`), and what passes is written
anew from what was read: each message as canonical JSON (ASCII only), each event with
LF line ends. What cannot be read is not passed on: the client gets a JSON-RPC error for
each request still waiting for its answer (`Answers.refusal` says why, for the audit
line); on the server's own event stream (a GET), where no request waits, the stream is
cut (`Refusal` raised).

What is read, per message:

* a response (`result` or `error`) must answer a request of the exchange still waiting
  (`pending`, ids compared by type and value: `"102"` does not answer 102), each once;
  on a GET stream, where answers to any request of the session may come, its id must
  be a string or an integer. A result's `tools` list is filtered (`mcp.ListFilter`);
  the answer to a request the gateway relayed as a ping becomes its refusal
  (`mcp.relayed_answer`);
* a request of the server's own (sampling, elicitation, roots: a `method` with an id)
  reaches the client only under `mcp.server_requests: allow` (a `ping` always does);
  refused, it goes on as a `ping` under the same id, and the client's answer to it
  becomes the refusal on its way to the server (`mcp.answer_asks`);
* a notification passes.

Per transport: an `application/json` answer is held whole (`MAX_ANSWER`) and must be a
message or a batch; a `text/event-stream` answer is read event by event (one held at
most `MAX_ANSWER`): `message` events carry one message each, `endpoint` events (the
older HTTP+SSE transport) a URL, other events and comments are dropped (no MCP client
reads them; a comment goes on as an empty one, a keep-alive). A WebSocket message is one
message or batch (`Answers.message`).
"""

from __future__ import annotations

import re
from typing import Any

from gateway.core import mcp, strictjson
from gateway.core.policy.mcp_rule import McpRule
from gateway.core.refusal import Refusal, rpc_error
from gateway.core.sse import Comment, Event, EventStream, SseError, frame

__all__ = ["JSON", "MAX_ANSWER", "SSE", "Answers", "media_type"]

MAX_ANSWER = mcp.MAX_BODY  # a JSON answer, or one event, is read whole up to this
JSON, SSE = "application/json", "text/event-stream"
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_QUOTED = r'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t !-~\x80-\xff])*"'
_PARAMETER = rf"({_TOKEN})=({_TOKEN}|{_QUOTED})"
# Possessive (`*+`): giving back a space or a parameter never makes a match, and with
# backtracking `;` and spaces cost 2^n (`a/b` and 30 of `; `: minutes, from an MCP
# server's Content-Type).
_MEDIA_TYPE = re.compile(rf"[ \t]*+({_TOKEN})/({_TOKEN})"
                         rf"((?:[ \t]*+;[ \t]*+(?:{_PARAMETER})?)*+)[ \t]*")
_PARAMETERS = re.compile(_PARAMETER)
_KEEP_ALIVE = b":\n"


def media_type(values: list[str]) -> str | None:
    """The media type (`type/subtype`, lower case) of the Content-Type field `values`,
    parameters read by RFC 9110 (`text/plain; x=application/json` is text/plain); None
    without exactly one well-formed value, or with a charset other than UTF-8 (JSON and
    event streams are UTF-8 only)."""
    if len(values) != 1:
        return None
    found = _MEDIA_TYPE.fullmatch(values[0])
    if found is None:
        return None
    for name, value in _PARAMETERS.findall(found.group(3)):
        if name.lower() == "charset" and value.strip('"').lower() != "utf-8":
            return None
    return f"{found.group(1)}/{found.group(2)}".lower()


def _printable(text: str) -> bool:
    """Text another reader cannot split into lines (U+2028, NEL, VT: Python's
    `str.splitlines`, which some SSE clients use, breaks lines there)."""
    return text.isascii() and text.isprintable()


class Answers:
    """The answer to one exchange (see the module docstring): `feed` and `end` for an
    HTTP body (`sse`: an event stream, else one JSON document), `message` for each
    WebSocket message from the server. `pending`: the requests waiting for an answer
    (by `mcp.key`; None: a GET stream, answers to any request may come); `batch`: the
    requests were sent as a batch (a JSON refusal is then an array); `asks`: where the
    errors for refused server requests are kept until the client answers them; `drop`:
    a body that is no answer (a 202's, or one that answers only notifications), read
    by no client: dropped."""

    def __init__(self, rule: McpRule, session: mcp.Session, *, sse: bool,
                 pending: dict[mcp.Key, Any] | None, batch: bool = False,
                 asks: dict[mcp.Key, dict[str, Any]] | None = None,
                 source: str | None = None, where: str = "", drop: bool = False,
                 pins: mcp.Pinned | None = None) -> None:
        self.rule, self.session, self.sse, self.drop = rule, session, sse, drop
        self.pending, self.batch, self.source, self.where = pending, batch, source, where
        self.asks = session.asks if asks is None else asks
        self.lists = mcp.ListFilter(rule, session, pins)
        self.pins = pins
        self.calls: list[dict[str, Any]] = []  # the server requests, for the audit line
        self.refusal: Refusal | None = None  # why the answer was not passed on
        self._stream = EventStream(MAX_ANSWER) if sse else None
        self._held: list[bytes] = []
        self._size = 0
        self._tail = b""  # what the end sends (the errors for an answer refused whole)

    def refuse_whole(self, why: str) -> None:
        """Nothing of the answer is read (`why`: its content type is not one an MCP
        answer has): the body sent in its place is the errors for the requests waiting,
        as JSON (empty on a GET stream, where none waits)."""
        self.sse, self._stream = False, None
        self._tail = self._refuse(why, cut=False)

    # -- HTTP bodies ---------------------------------------------------------------------

    def feed(self, data: bytes) -> bytes:
        """What of the answer may reach the client now. Raises Refusal (a GET stream
        the gateway cannot read: the engine cuts it)."""
        if self.refusal is not None or self.drop:
            return b""  # (what follows an answer refused is not read)
        if self._stream is None:
            self._size += len(data)
            if self._size > MAX_ANSWER:
                return self._refuse(f"a JSON answer over {MAX_ANSWER} bytes")
            self._held.append(data)
            return b""
        try:
            items = self._stream.feed(data)
        except SseError as exc:
            return self._refuse(f"an event stream that cannot be read one way: {exc}")
        out: list[bytes] = []
        for item in items:
            if isinstance(item, Comment):
                out.append(_KEEP_ALIVE)
                continue
            try:
                out.append(self._event(item))
            except mcp.Unreadable as exc:
                out.append(self._refuse(str(exc)))
                break
        return b"".join(out)

    def end(self) -> bytes:
        """The rest of the answer at its end."""
        if self.refusal is not None or self.drop:
            tail, self._tail = self._tail, b""
            return tail
        if self._stream is not None:
            if self._stream.end():
                return self._refuse("an event stream that ended inside an event (a "
                                    "client does not dispatch it)", cut=False)
            return b""
        body, self._held = b"".join(self._held), []
        if not body:  # (no answer: an error for each request waiting, if one does)
            return self._refuse("an empty answer") if self.pending else b""
        try:
            return self._body(body)
        except mcp.Unreadable as exc:
            return self._refuse(str(exc))

    # -- WebSocket -----------------------------------------------------------------------

    def message(self, data: bytes) -> bytes:
        """A WebSocket message from the server as the client may read it. Raises
        Unreadable (`errors` then answers the requests waiting)."""
        return self._body(data)

    def errors(self, refusal: Refusal) -> list[dict[str, Any]]:
        """The JSON-RPC errors answering every request still waiting (then none is)."""
        waiting = list((self.pending or {}).values())
        if self.pending is not None:
            self.pending.clear()
        return [rpc_error(refusal, ident) for ident in waiting]

    # -- reading -------------------------------------------------------------------------

    def refused(self, why: str) -> Refusal:
        """The refusal of an answer the gateway cannot read (`why`)."""
        return Refusal("upstream_failed", f"the MCP server {self.where} answered what the "
                       f"gateway cannot read by the rule's mcp: ({why}); it was not passed "
                       "on, and each request waiting for it was answered with this error",
                       self.source)

    def _refuse(self, why: str, cut: bool = True) -> bytes:
        """Refuse the answer: errors for the requests waiting, in the answer's own form
        (on a GET stream, cut it: raises Refusal)."""
        refusal = self.refusal = self.refused(why)
        if self.pending is None:
            if cut:
                raise refusal
            return b""
        errors = self.errors(refusal)
        if not errors:
            return b""
        if self.sse:
            return b"".join(frame(Event(data=[strictjson.dumps(e).decode()]))
                            for e in errors)
        return strictjson.dumps(errors if self.batch or len(errors) > 1 else errors[0])

    def _body(self, body: bytes) -> bytes:
        try:
            doc = strictjson.loads(body)
        except strictjson.StrictJsonError as exc:
            raise mcp.Unreadable(f"not strict JSON: {exc}") from None
        batch = isinstance(doc, list)
        messages = doc if batch else [doc]
        if not messages:
            raise mcp.Unreadable("an empty batch")
        waiting = dict(self.pending) if self.pending is not None else None
        try:
            try:
                out = [self._message(m) for m in messages]
                return strictjson.dumps(out if batch else out[0])
            except (RecursionError, ValueError):  # (nested too deep to write back)
                raise mcp.Unreadable("a message nested too deep to write back") from None
        except mcp.Unreadable:
            if self.pending is not None and waiting is not None:  # (none of it answered)
                self.pending.clear()
                self.pending.update(waiting)
            raise

    def _event(self, event: Event) -> bytes:
        if event.id is not None and not _printable(event.id):
            raise mcp.Unreadable("an event id that is not printable ASCII")
        text = event.text
        if text is None:  # (dispatches nothing; its id and retry still count)
            return frame(Event(id=event.id, retry=event.retry))
        kind = event.kind
        if kind == "message":
            data = self._body(text.encode()).decode()
            return frame(Event(data=[data], id=event.id, retry=event.retry))
        if kind == "endpoint":  # (the older HTTP+SSE transport: where to POST)
            if not _printable(text) or text.lstrip()[:1] in ("{", "["):
                raise mcp.Unreadable("an endpoint event that is not a URL")
            if self.pins is not None:  # (its POSTs' pins are this server's)
                self.pins.endpoint(text)
            return frame(Event(type=kind, data=[text], id=event.id, retry=event.retry))
        return frame(Event(id=event.id, retry=event.retry))  # (no MCP client reads it)

    def _message(self, message: Any) -> dict[str, Any]:
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            raise mcp.Unreadable('a message that is not a JSON-RPC 2.0 object')
        mcp.exact(message)
        if "method" in message:
            return self._request(message)
        if ("result" in message) == ("error" in message):
            raise mcp.Unreadable("a message with neither a method nor one of result and "
                                 "error")
        ident = message.get("id")
        if not mcp.valid_id(ident):
            raise mcp.Unreadable("an answer whose id is not a string or an integer")
        pending = self.pending
        if pending is not None and pending.pop(mcp.key(ident), _NONE) is _NONE:
            raise mcp.Unreadable('an answer whose id matches no request waiting in this '
                                 'exchange (ids compare by type and value: "102" does '
                                 'not answer 102)')
        if isinstance(ident, str) and ident.startswith(mcp.RELAYED):
            return mcp.relayed_answer(self.session, ident)
        result = message.get("result")
        if isinstance(result, dict):
            mcp.exact(result)
            tools = result.get("tools")
            if isinstance(tools, list):
                for tool in tools:
                    if isinstance(tool, dict):
                        mcp.exact(tool)
                result["tools"] = self.lists.tools(tools)
        return message

    def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        """A request or notification of the server's: passed, or (a request that
        `mcp.server_requests` refuses) a ping in its place."""
        method = message["method"]
        if not isinstance(method, str):
            raise mcp.Unreadable("a JSON-RPC method that is not a string")
        if "result" in message or "error" in message:
            raise mcp.Unreadable("a message with a method and a result or error")
        params = message.get("params")
        if params is not None:
            if not isinstance(params, dict):
                raise mcp.Unreadable("params that are not an object")
            mcp.exact(params)
        ident = message.get("id")
        if ident is None:
            return message  # a notification
        if not mcp.valid_id(ident):
            raise mcp.Unreadable("a server request whose id is not a string or an integer")
        if method == "ping" or self.rule.server_requests == "allow":
            self.calls.append({"method": method[:64], "name": None, "decision": "allow",
                               "from": "server"})
            return message
        self.calls.append({"method": method[:64], "name": None, "decision": "deny",
                           "from": "server"})
        refusal = Refusal("mcp_denied", "the MCP server asked the client (sampling, "
                          "elicitation, roots or another request of its own), and the "
                          "rule's mcp.server_requests is deny (set it to allow to let "
                          "servers ask)", self.source)
        self.asks[mcp.key(ident)] = rpc_error(refusal, ident)
        while len(self.asks) > mcp.RELAYS:
            del self.asks[next(iter(self.asks))]
        return {"jsonrpc": "2.0", "id": ident, "method": "ping"}


_NONE = object()
