"""An exchange on a rule with ``mcp:``: its JSON-RPC calls decided (the body stage's MCP
step, `core/body_stage.mcp_stage`), and every answer of the server, on HTTP or a
WebSocket, read before the client sees it (`core/mcp_answers.py`).

A refused POST is answered with JSON-RPC errors; a client of the older HTTP+SSE
transport (one that does not accept an event stream in answer to its POST) has its
refused requests relayed as pings, answered on its stream (`mcp.relay`). A refused
WebSocket message is answered with its errors while the session goes on
(`MessageRefused`). Under ``mode: report`` refusals are only recorded.
"""

from __future__ import annotations

from typing import Any

from gateway.core import mcp, strictjson
from gateway.core.body_stage import NO_CALLS, Stage, mcp_stage
from gateway.core.evaluate import UNSEEN
from gateway.core.mcp import Call
from gateway.core.mcp_answers import JSON, SSE, Answers, media_type
from gateway.core.messages import ResponseHead
from gateway.core.policy.mcp_rule import McpRule
from gateway.core.refusal import ERROR_HEADER, MessageRefused, Refusal, rpc_error
from gateway.pipeline.exchange_state import ExchangeState, source_of

__all__ = ["McpCalls"]


class McpCalls:
    """The MCP side of one exchange (see the module docstring)."""

    def __init__(self, ex: ExchangeState, rule: McpRule, session: mcp.Session, *,
                 report: bool, pins: mcp.Pinned | None = None) -> None:
        """Set up by the gate: `session` the MCP session, `pins` the server's tool pins
        (`pin_descriptions`). A method no MCP transport uses is refused (raises)."""
        self.ex = ex
        self.rule = rule
        self.session = session
        self.mode = "report" if report else "enforce"
        self.pins = pins
        self.pending: dict[mcp.Key, Any] = {}  # requests sent, waiting for answers
        self.batch = False  # they went as a batch
        self.asks: dict[mcp.Key, dict[str, Any]] = {}  # a WebSocket's refused asks
        self.answers: Answers | None = None  # reads the server's answers
        self.relayed: Refusal | None = None  # refused, answered through the server
        self._refused(mcp_stage(rule, self.mode, ex.head.method, UNSEEN, frozenset(),
                                source_of(ex.decision)))

    @property
    def reads(self) -> bool:
        """A body of JSON-RPC calls to decide (what an MCP client POSTs)."""
        return self.ex.head.method == "POST"

    def _refused(self, stage: Stage) -> None:
        """A refusal of the request before any call was read: recorded under mode:
        report, else raised."""
        if stage.refusal is None:
            return
        self.ex.mcp_calls = [dict(c) for c in NO_CALLS]
        if stage.report:
            self.ex.report = stage.refusal
            return
        raise stage.refusal

    def no_unread_body(self, body: bytes) -> None:
        """A GET or DELETE carrying a body is refused (never read; raises Refusal)."""
        if self.ex.head.method != "POST":
            self._refused(mcp_stage(self.rule, self.mode, self.ex.head.method, body,
                                    frozenset(), source_of(self.ex.decision)))

    def check(self, body: bytes | None) -> bytes | None:
        """Every call in the body allowed by the rule, or the body refused whole (raises
        Refusal, answered as JSON-RPC errors); for a client of the older HTTP+SSE
        transport the refused requests are relayed as pings instead, and the body to
        send returned. The client's answers to server requests the gateway refused are
        rewritten into those refusals (`mcp.answer_asks`): the body to send then too."""
        found, refusal = self.judge(body)
        self.pending = {mcp.key(c.id): c.id for c in found if c.is_request}
        self.batch = bool(found) and (body or b"").lstrip(b" \t\r\n")[:1] == b"["
        if refusal is None or self.mode == "report":
            asks = self.session.asks
            return mcp.answer_asks(body, asks) if asks and body is not None else None
        accept = (self.ex.head.headers.get("accept") or "").lower()
        if refusal.rpc is None or not refusal.rpc[0] or "text/event-stream" in accept:
            raise refusal
        self.relayed = refusal
        relayed = mcp.relay(self.session, refusal)
        self.pending = {mcp.key(ping["id"]): ident  # (the pings' answers are awaited)
                        for ping, ident in zip(mcp.read(relayed)[0], refusal.rpc[0],
                                               strict=True)}
        return relayed

    def judge(self, body: bytes | None) -> tuple[list[Call], Refusal | None]:
        """The body stage's MCP step on a body (or WebSocket message, judged as a POST's
        body would be), its calls on the audit line and counted; under `mode: report` a
        refusal is only recorded (returned, not to be raised)."""
        ex = self.ex
        stage = mcp_stage(self.rule, self.mode, "POST", body,
                          self.session.changed if self.pins is None else self.pins,
                          source_of(ex.decision))
        found = list(stage.calls)
        called = [c for c in found if c.method is not None]
        records = [c.record() for c in called] if found else [dict(c) for c in NO_CALLS]
        ex.note_calls(records)
        for record in records:
            ex.trail.telemetry.count("mcp_calls", ex.identity.policy, str(record["decision"]))
        if stage.report:
            ex.report = stage.refusal
        return found, stage.refusal

    # -- the server's answers ---------------------------------------------------------------

    def read_answers(self, head: ResponseHead) -> None:
        """The server's answers are read before the client sees them: a POST's, which
        must be JSON or an event stream answering its requests, and the event stream a
        GET opens. A status other than 2xx is an HTTP error, no answer (clients do not
        read its body as JSON-RPC): it passes, as does a DELETE's answer and a GET's
        that no event stream was asked for. An answer of another content type is
        replaced whole: by the JSON-RPC errors of the requests waiting (an empty event
        stream on a GET), its head saying why (`X-Sandbox-Gateway-Error`)."""
        ex = self.ex
        method = ex.head.method
        if not 200 <= head.status < 300 or method not in ("POST", "GET"):
            return
        kind = media_type(head.headers.get_all("content-type"))
        asked = "text/event-stream" in (ex.head.headers.get("accept") or "").lower()
        if method == "GET" and kind != SSE and not asked:
            return
        pending: dict[mcp.Key, Any] | None = None if method == "GET" else self.pending
        drop = method == "POST" and (head.status == 202 or (  # (no answer: 202 Accepted,
            kind not in (JSON, SSE) and not pending))  # or one to notifications only)
        answers = self.answers = Answers(
            self.rule, self.session, sse=kind == SSE, pending=pending, batch=self.batch,
            source=source_of(ex.decision), where=ex.where(), drop=drop, pins=self.pins)
        if drop:
            return
        if kind not in (JSON, SSE):
            answers.refuse_whole("a content type other than application/json or "
                                 "text/event-stream")
            kind = SSE if method == "GET" else JSON
            head.headers.set(ERROR_HEADER, "upstream_failed")
        head.headers.set("Content-Type", kind)  # (as read: no parameter goes on)

    def note_answers(self) -> None:
        """What the answers showed, on the audit line: tools whose description changed
        in this session, the server's own requests and their decisions."""
        answers = self.answers
        if answers is None:
            return
        changed = answers.lists.changed
        verdict = "hidden" if self.rule.pin_descriptions else "changed"
        records = [*answers.calls, *({"method": "tools/list", "name": name[:200],
                                      "decision": f"description_{verdict}"}
                                     for name in changed)]
        for record in answers.calls:
            self.ex.trail.telemetry.count("mcp_calls", self.ex.identity.policy,
                                          str(record["decision"]))
        answers.calls, answers.lists.changed = [], []
        if records:
            self.ex.note_calls(records)

    def refusal(self) -> Refusal | None:
        """The refusal the client got through the server (a relayed ping, or an answer
        not passed on), for the audit line; what the answers showed noted first."""
        self.note_answers()
        return self.relayed or (self.answers.refusal if self.answers is not None else None)

    # -- a WebSocket's messages --------------------------------------------------------------

    def sent(self, data: bytes) -> bytes:
        """A client's WebSocket message, judged as a POST's body: a refused one is
        answered with its JSON-RPC errors while the session goes on (raises
        MessageRefused); its requests then wait for their answers."""
        found, refusal = self.judge(data)
        if refusal is not None and self.mode != "report":
            ids, batch = refusal.rpc or ([], False)
            errors = [rpc_error(refusal, i) for i in ids] or \
                ([] if found else [rpc_error(refusal, None)])  # (notifications: no answer)
            reply = strictjson.dumps(errors if batch else errors[0]) if errors else b""
            self._refuse(refusal, reply, [c.record() for c in found if c.method] or
                         [dict(c) for c in NO_CALLS])
        for call in found:
            if call.is_request:
                self.pending[mcp.key(call.id)] = call.id
        while len(self.pending) > mcp.RELAYS * 16:  # (a client that never hears back)
            del self.pending[next(iter(self.pending))]
        if self.asks:
            return mcp.answer_asks(data, self.asks) or data
        return data

    def received(self, data: bytes) -> bytes:
        """A server's WebSocket message, read as an answer: what the client may read, or
        (unreadable) dropped while every request waiting gets its JSON-RPC error (raises
        MessageRefused)."""
        ex = self.ex
        if self.answers is None:
            self.answers = Answers(self.rule, self.session, sse=False, pending=self.pending,
                                   asks=self.asks, source=source_of(ex.decision),
                                   where=ex.where(), pins=self.pins)
        try:
            out = self.answers.message(data)
        except mcp.Unreadable as exc:
            refusal = self.answers.refused(str(exc))
            errors = self.answers.errors(refusal)
            self._refuse(refusal, strictjson.dumps(errors[0] if len(errors) == 1
                                                   else errors) if errors else b"", None)
        self.note_answers()
        return out

    def _refuse(self, refusal: Refusal, reply: bytes,
                calls: list[dict[str, Any]] | None) -> None:
        """One MCP message of a WebSocket refused: audited with its `calls`, `reply`
        sent to the client (raises MessageRefused)."""
        self.ex.audit_message(refusal, calls)
        raise MessageRefused(refusal, reply)
