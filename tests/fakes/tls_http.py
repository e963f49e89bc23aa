"""Threaded TLS servers on 127.0.0.1:0 for the local upstreams of the client matrix:
an `http.server` handler or a WSGI app behind a leaf of a throwaway CA, recording the
request heads that arrive (to check what a sandbox's client really sent upstream)."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


@dataclass
class Head:
    """One request head as it arrived upstream."""

    method: str
    path: str
    headers: dict[str, str]


@dataclass
class Recorder:
    heads: list[Head] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, head: Head) -> None:
        with self._lock:
            self.heads.append(head)

    def text(self) -> str:
        """Everything recorded, for `token not in …` checks."""
        with self._lock:
            return "\n".join(f"{h.method} {h.path} {h.headers}" for h in self.heads)


class TLSServer:
    """A started server; `port`, `recorder`, `stop()`."""

    def __init__(self, server: ThreadingHTTPServer | WSGIServer, ctx: ssl.SSLContext,
                 recorder: Recorder) -> None:
        server.daemon_threads = True  # type: ignore[attr-defined]
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
        self.server = server
        self.recorder = recorder
        self._thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_handler(handler: type[BaseHTTPRequestHandler], ctx: ssl.SSLContext,
                  recorder: Recorder) -> TLSServer:
    """Serve an `http.server` handler class (it records through `self.server.recorder`)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.recorder = recorder  # type: ignore[attr-defined]
    return TLSServer(server, ctx, recorder)


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    pass


class _QuietWSGIHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_wsgi(app: WSGIApp, ctx: ssl.SSLContext, recorder: Recorder) -> TLSServer:
    """Serve a WSGI app, recording each request head."""

    def recording(environ: dict[str, Any], start_response: Callable[..., Any]
                  ) -> Iterable[bytes]:
        headers = {k[5:].replace("_", "-").lower(): str(v) for k, v in environ.items()
                   if k.startswith("HTTP_")}
        recorder.add(Head(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), headers))
        # No range answers: bottle (pypiserver) never closes a file it sent a range of.
        environ.pop("HTTP_RANGE", None)
        result = app(environ, start_response)
        try:  # read it all here: a file the app returns is closed even if the client goes
            return [b"".join(result)]
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()

    server = _ThreadingWSGIServer(("127.0.0.1", 0), _QuietWSGIHandler)
    server.set_app(recording)
    return TLSServer(server, ctx, recorder)
