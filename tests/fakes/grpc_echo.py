"""A gRPC server over TLS with one unary method, `/matrix.Echo/Say`, that answers its
request bytes prefixed with `echo:` (grpcio generic handlers: no generated code)."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from helpers.tls import LocalCA

from fakes.tls_http import Head, Recorder

METHOD = "/matrix.Echo/Say"


class GrpcEcho:
    """`port`, `recorder` (method + metadata of each call), `stop()`."""

    def __init__(self, directory: Path, ca: LocalCA, names: list[str]) -> None:
        self.recorder = Recorder()
        cert, key = ca.issue(directory, names)
        creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
        handler = grpc.method_handlers_generic_handler("matrix.Echo", {
            "Say": grpc.unary_unary_rpc_method_handler(self._say)})
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                  handlers=[handler])
        self._port = self.server.add_secure_port("127.0.0.1:0", creds)
        self.server.start()

    def _say(self, request: bytes, context: Any) -> bytes:
        metadata = {k.lower(): str(v) for k, v in context.invocation_metadata()}
        self.recorder.add(Head("POST", METHOD, metadata))
        return b"echo:" + request

    @property
    def port(self) -> int:
        return self._port

    def stop(self) -> None:
        self.server.stop(grace=None)
