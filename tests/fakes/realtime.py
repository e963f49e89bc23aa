"""A fake of OpenAI's WebSocket APIs: a TLS WebSocket server (the `websockets` package).

* The Realtime API (any path but ``/v1/responses``, e.g. ``/v1/realtime?model=...``):
  `session.created` when a session opens; `session.update` answers `session.updated`
  with the session merged with the update (``model`` included when given); for each
  `response.create` a `response.created`, a transcript delta and a `response.done` with
  that response's usage (input 100 + n, output 20, cached 8 * n for the n-th).
* The Responses API over WebSocket (``/v1/responses``, what the openai SDK's
  ``client.responses.connect()`` and the Codex CLI use): no greeting; for each
  ``{"type": "response.create", <the fields of POST /v1/responses>}`` the events of a
  streamed response (`response.created`, `response.in_progress`, the output item's
  events, `response.completed` with `response.usage`), each with a `sequence_number`
  (from 0 per response) and the create's `stream_id` if it had one. A create without
  ``model``, with ``background: true`` or with an unknown ``previous_response_id`` (this
  connection's responses, or the stored ones) gets ``{"type": "error", "status": 400,
  "error": {"type": "invalid_request_error", "code", "message", "param"}}``; any other
  client event type too (``response.steer`` is not implemented); the socket stays open.

Alone (``FakeRealtime(directory, ca, names)``) it accepts any upgrade and counts
Responses tokens as the HTTP fake does with its defaults. Started by
``FakeInference(websocket=True)`` (``inference=``) it shares that fake's counts
(``cached_tokens``, ``output_tokens``), its stored responses (a response made here is
retrievable by ``GET /v1/responses/{id}`` unless ``store: false``) and its keys: an
upgrade needs ``Authorization: Bearer`` with the API key or a live minted ``ek_``
secret — or, as a browser sends it, the subprotocol ``openai-insecure-api-key.<key>``
(the ``realtime`` subprotocol is then chosen, if offered) — else it is refused 401
(recorded in ``rejected``).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

import websockets.exceptions
from helpers.tls import LocalCA
from websockets.datastructures import Headers
from websockets.http11 import Request, Response
from websockets.sync.server import Server, ServerConnection, serve
from websockets.typing import Subprotocol

from fakes.inference import (
    FakeInference,
    count,
    max_output,
    new_id,
    response_events,
    response_object,
    snapshot,
)

SNAPSHOT = "-2025-08-28"


@dataclass
class WsConnection:
    """One WebSocket session: its upgrade and every event each way."""

    path: str
    headers: dict[str, str]
    received: list[dict[str, Any]] = field(default_factory=list)
    sent: list[dict[str, Any]] = field(default_factory=list)


class _Send(Protocol):
    def __call__(self, kind: str, /, **fields: Any) -> None: ...


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


BROWSER_KEY = "openai-insecure-api-key."  # a browser's key: a WebSocket subprotocol


def _realtime_subprotocol(conn: ServerConnection, offered: Sequence[Subprotocol]
                          ) -> Subprotocol | None:
    return Subprotocol("realtime") if "realtime" in offered else None


class FakeRealtime:
    """`port`, `upgrades` (headers of each session's upgrade), `received` (the client
    events of every session), `connections` (path, headers, received and sent events of
    each session), `rejected` (headers of refused upgrades), `stop()`."""

    def __init__(self, directory: Path, ca: LocalCA, names: list[str], *,
                 inference: FakeInference | None = None) -> None:
        self.inference = inference
        self.upgrades: list[dict[str, str]] = []
        self.received: list[dict[str, Any]] = []
        self.connections: list[WsConnection] = []
        self.rejected: list[dict[str, str]] = []
        self._stored: dict[str, dict[str, Any]] = {}  # alone: the responses made here
        self._lock = threading.Lock()
        directory.mkdir(parents=True, exist_ok=True)
        ctx = ca.server_context(directory, names)
        ctx.set_alpn_protocols(["http/1.1"])
        self.server: Server = serve(self._session, "127.0.0.1", 0, ssl=ctx,
                                    process_request=self._authorize,
                                    select_subprotocol=_realtime_subprotocol)
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @staticmethod
    def usage(n: int) -> tuple[int, int, int]:
        """(input, output, cached) tokens of the session's n-th response (from 0)."""
        return 100 + n, 20, 8 * n

    def _authorize(self, conn: ServerConnection, request: Request) -> Response | None:
        if self.inference is None:
            return None
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer ") and self.inference.openai_token_ok(auth[7:]):
            return None
        offered = [p.strip() for value in request.headers.get_all("Sec-WebSocket-Protocol")
                   for p in value.split(",")]
        if any(p.startswith(BROWSER_KEY) and self.inference.openai_token_ok(
                p[len(BROWSER_KEY):]) for p in offered):
            return None
        self.rejected.append({k.lower(): v for k, v in request.headers.raw_items()})
        body = json.dumps({"error": {
            "message": "Incorrect API key provided.", "type": "invalid_request_error",
            "param": None, "code": "invalid_api_key"}}).encode()
        return Response(HTTPStatus.UNAUTHORIZED.value, HTTPStatus.UNAUTHORIZED.phrase,
                        Headers([("Content-Type", "application/json"),
                                 ("Content-Length", str(len(body)))]), body)

    def _session(self, conn: ServerConnection) -> None:
        request = conn.request
        assert request is not None
        headers = {k.lower(): v for k, v in request.headers.raw_items()}
        record = WsConnection(request.path, headers)
        self.upgrades.append(headers)
        self.connections.append(record)
        with contextlib.suppress(websockets.exceptions.ConnectionClosed):
            if urlsplit(request.path).path.rstrip("/") == "/v1/responses":
                self._responses(conn, record)
            else:
                self._realtime(conn, record)

    def _events(self, conn: ServerConnection, record: WsConnection
                ) -> Iterator[dict[str, Any] | None]:
        """The client's events: JSON objects, or None for any other message."""
        for message in conn:
            try:
                event = json.loads(message)
            except ValueError:
                event = None
            if isinstance(event, dict):
                record.received.append(event)
                self.received.append(event)
                yield event
            else:
                yield None

    # -- Realtime ------------------------------------------------------------------------

    def _realtime(self, conn: ServerConnection, record: WsConnection) -> None:
        send = self._sender(conn, record)
        model = parse_qs(urlsplit(record.path).query).get("model", ["gpt-realtime"])[0]
        session: dict[str, Any] = {"type": "realtime", "object": "realtime.session",
                                   "id": "sess_1", "model": model + SNAPSHOT}
        send("session.created", session=session)
        n = 0
        for event in self._events(conn, record):
            if event is None:
                send("error", error={"type": "invalid_request_error", "code": "invalid_json",
                                     "message": "The message is not a JSON object.",
                                     "param": None, "event_id": None})
                continue
            kind = event.get("type")
            if kind == "session.update":
                session = _merge(session, event.get("session") or {})
                send("session.updated", session=session)
            if kind != "response.create":
                continue
            n_in, n_out, cached = self.usage(n)
            send("response.created", response={"id": f"resp_{n}", "status": "in_progress"})
            send("response.audio_transcript.delta", response_id=f"resp_{n}", delta="Hi")
            send("response.done", response={
                "object": "realtime.response", "id": f"resp_{n}", "status": "completed",
                "usage": {"total_tokens": n_in + n_out, "input_tokens": n_in,
                          "output_tokens": n_out,
                          "input_token_details": {"cached_tokens": cached,
                                                  "text_tokens": n_in, "audio_tokens": 0},
                          "output_token_details": {"text_tokens": n_out,
                                                   "audio_tokens": 0}}})
            n += 1

    @staticmethod
    def _sender(conn: ServerConnection, record: WsConnection) -> _Send:
        counter = iter(range(1 << 30))

        def send(kind: str, /, **fields: Any) -> None:
            event = {"type": kind, "event_id": f"event_{next(counter)}", **fields}
            record.sent.append(event)
            conn.send(json.dumps(event))
        return send

    # -- Responses over WebSocket ----------------------------------------------------------

    def _responses(self, conn: ServerConnection, record: WsConnection) -> None:
        local: set[str] = set()  # this connection's responses (store: false ones too)

        def raw(event: dict[str, Any]) -> None:
            record.sent.append(event)
            conn.send(json.dumps(event))

        for event in self._events(conn, record):
            if event is None:
                raw({"type": "error", "status": 400, "error": {
                    "type": "invalid_request_error", "code": "invalid_json",
                    "message": "The message is not a JSON object.", "param": None}})
                continue
            lane = {"stream_id": event["stream_id"]} if "stream_id" in event else {}

            def error(code: str, message: str, param: str | None,
                      lane: dict[str, Any] = lane) -> None:
                raw({"type": "error", "status": 400, "error": {
                    "type": "invalid_request_error", "code": code, "message": message,
                    "param": param}, **lane})

            if event.get("type") != "response.create":
                error("unsupported_event_type",
                      f"Unsupported event type '{event.get('type')}'.", "type")
                continue
            if not event.get("model"):
                error("missing_required_parameter", "Missing required parameter: 'model'.",
                      "model")
                continue
            if event.get("background") is True:
                error("unsupported_parameter", "Unsupported parameter: 'background' is "
                      "not supported over WebSocket.", "background")
                continue
            previous = event.get("previous_response_id")
            if previous is not None and previous not in local and not self._known(previous):
                error("previous_response_not_found",
                      f"Previous response with id '{previous}' not found.",
                      "previous_response_id")
                continue
            req = {k: v for k, v in event.items() if k not in ("type", "stream_id", "stream")}
            final = self._new_response(req)
            local.add(final["id"])
            interval = self.inference.interval if self.inference is not None else 0.0
            for i, item in enumerate(response_events(final)):
                if interval and i:
                    time.sleep(interval)
                raw({**item, **lane})

    def _known(self, rid: str) -> bool:
        if self.inference is not None:
            with self.inference.lock:
                return rid in self.inference.responses
        with self._lock:
            return rid in self._stored

    def _new_response(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.inference is not None:
            return self.inference.new_response(req)
        counts = count({"input": req.get("input")}, cap=max_output(req, "max_output_tokens"))
        final = response_object(req, counts, rid=new_id("resp_", 24),
                                 model=snapshot(str(req["model"])), created=int(time.time()))
        if req.get("store", True) is not False:
            with self._lock:
                self._stored[final["id"]] = final
        return final

    @property
    def port(self) -> int:
        return int(self.server.socket.getsockname()[1])

    def stop(self) -> None:
        self.server.shutdown()
        self._thread.join(5)
