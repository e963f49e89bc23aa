"""A fake OpenAI Realtime API: a TLS WebSocket server (the `websockets` package) that
sends the documented server events: `session.created` when a session opens, then for
each `response.create` a `response.created`, a transcript delta and a `response.done`
with that response's usage (input 100 + n, output 20, cached 8 * n for the n-th)."""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import websockets.exceptions
from helpers.tls import LocalCA
from websockets.sync.server import Server, ServerConnection, serve

SNAPSHOT = "-2025-08-28"


class FakeRealtime:
    """`port`, `upgrades` (headers of each session's upgrade), `received` (the client
    events of every session), `stop()`."""

    def __init__(self, directory: Path, ca: LocalCA, names: list[str]) -> None:
        self.upgrades: list[dict[str, str]] = []
        self.received: list[dict[str, Any]] = []
        directory.mkdir(parents=True, exist_ok=True)
        ctx = ca.server_context(directory, names)
        ctx.set_alpn_protocols(["http/1.1"])
        self.server: Server = serve(self._session, "127.0.0.1", 0, ssl=ctx)
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @staticmethod
    def usage(n: int) -> tuple[int, int, int]:
        """(input, output, cached) tokens of the session's n-th response (from 0)."""
        return 100 + n, 20, 8 * n

    def _session(self, conn: ServerConnection) -> None:
        request = conn.request
        assert request is not None
        self.upgrades.append({k.lower(): v for k, v in request.headers.raw_items()})
        model = parse_qs(urlsplit(request.path).query).get("model", ["gpt-realtime"])[0]
        send = self._sender(conn)
        send("session.created", session={"object": "realtime.session", "id": "sess_1",
                                         "model": model + SNAPSHOT})
        n = 0
        with contextlib.suppress(websockets.exceptions.ConnectionClosed):
            for message in conn:
                event = json.loads(message)
                self.received.append(event)
                if event.get("type") != "response.create":
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
    def _sender(conn: ServerConnection) -> Any:
        counter = iter(range(1 << 30))

        def send(kind: str, **fields: Any) -> None:
            conn.send(json.dumps({"type": kind, "event_id": f"event_{next(counter)}",
                                  **fields}))
        return send

    @property
    def port(self) -> int:
        return int(self.server.socket.getsockname()[1])

    def stop(self) -> None:
        self.server.shutdown()
        self._thread.join(5)
