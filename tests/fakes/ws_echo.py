"""A WebSocket echo server over TLS (the `websockets` package), recording handshakes."""

from __future__ import annotations

import threading
from pathlib import Path

from helpers.tls import LocalCA
from websockets.sync.server import Server, ServerConnection, serve

from fakes.tls_http import Head, Recorder


class WsEcho:
    """Echoes every message; `port`, `recorder`, `stop()`."""

    def __init__(self, directory: Path, ca: LocalCA, names: list[str]) -> None:
        self.recorder = Recorder()
        ctx = ca.server_context(directory, names)
        ctx.set_alpn_protocols(["http/1.1"])
        self.server: Server = serve(self._echo, "127.0.0.1", 0, ssl=ctx)
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _echo(self, conn: ServerConnection) -> None:
        request = conn.request
        if request is not None:
            self.recorder.add(Head("GET", request.path,
                                   {k.lower(): v for k, v in request.headers.raw_items()}))
        for message in conn:
            conn.send(message)

    @property
    def port(self) -> int:
        return int(self.server.socket.getsockname()[1])

    def stop(self) -> None:
        self.server.shutdown()
