"""A small HTTPS server for fakes: TLS from a throwaway CA, one handler per request.

`FakeServer` listens on 127.0.0.1:<random port> in a background thread behind a
certificate for `hosts` (its CA is `ca_path`), so a gateway reaches it by name through
`network.resolve` and trusts it through `network.upstream_ca`. Subclasses implement
`handle(request) -> Reply`; a reply body may be bytes or an iterator of chunks (sent
chunked, flushed one by one: a stream). Request bodies may be chunked.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from helpers.tls import LocalCA

from fakes.http_body import read_body


@dataclass
class Request:
    method: str
    host: str
    path: str
    query: dict[str, list[str]]
    target: str
    headers: dict[str, str]
    body: bytes

    def form(self) -> dict[str, str]:
        return {k: v[0] for k, v in parse_qs(self.body.decode()).items()}


@dataclass
class Reply:
    status: int
    body: bytes | Iterable[bytes] = b""
    headers: dict[str, str] = field(default_factory=dict)


def json_reply(status: int, payload: Any, headers: dict[str, str] | None = None) -> Reply:
    import json

    return Reply(status, json.dumps(payload).encode(),
                 {"Content-Type": "application/json", **(headers or {})})


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # many clients connect at once (the default backlog is 5)


class FakeServer:
    """Base class; see the module docstring."""

    def __init__(self, directory: Path, hosts: list[str], name: str = "fake") -> None:
        self.directory = directory
        self.hosts = hosts
        self.ca = LocalCA.create(directory, name=f"{name} CA")
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def ca_path(self) -> Path:
        return self.ca.cert_path

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.server_address[1])

    def resolve(self) -> dict[str, str]:
        """`network.resolve` entries mapping every served name to this server."""
        return {h: f"127.0.0.1:{self.port}" for h in self.hosts if not h.startswith("*")}

    def handle(self, request: Request) -> Reply:
        raise NotImplementedError

    def start(self) -> FakeServer:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def setup(self) -> None:
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                super().setup()

            def _body(self) -> bytes:
                return read_body(self.headers, self.rfile)

            def _serve(self) -> None:
                url = urlsplit(self.path)
                headers = {k.lower(): v for k, v in self.headers.items()}
                request = Request(self.command, headers.get("host", "").split(":")[0].lower(),
                                  url.path, parse_qs(url.query), self.path, headers,
                                  self._body())
                with fake.lock:
                    fake.requests.append(request)
                reply = fake.handle(request)
                self.send_response(reply.status)
                for k, v in reply.headers.items():
                    self.send_header(k, v)
                if isinstance(reply.body, bytes):
                    self.send_header("Content-Length", str(len(reply.body)))
                    self.end_headers()
                    self.wfile.write(reply.body)
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                chunks: Iterator[bytes] = iter(reply.body)
                for chunk in chunks:
                    if chunk:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _serve

        server = _Server(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        server.socket = self.ca.server_context(self.directory, self.hosts).wrap_socket(
            server.socket, server_side=True)
        self._server = server
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
