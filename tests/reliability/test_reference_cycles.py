"""A connection's objects are freed when it ends, not at the next garbage collection.

An object in a reference cycle outlives its last use until the collector runs: every
intercepted request's exchange and its parts, every passthrough tunnel and every audited
refusal did (~35 objects a request, a keep-alive connection's until a full collection,
a sawtooth of 30-40 MiB under the soak's load). Here the gateway runs in this process,
the collector keeps what it finds unreachable (`gc.DEBUG_SAVEALL`) while real clients
go through it to a real nginx (plain and with a key swapped in, or leaving a download
halfway), and no object of the gateway's (nor an asyncio transport) may be among it.
"""

from __future__ import annotations

import gc
import socket
import ssl
import time
from collections import Counter
from collections.abc import Callable

import pytest
from helpers.clients import open_tunnel
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.nginx import Nginx
from helpers.tls import LocalCA


class Client:
    def __init__(self, gw: GatewayThread, ca: LocalCA) -> None:
        assert gw.gateway.proxy_address is not None
        self.address = gw.gateway.proxy_address
        self.token = gw.mint("agent")
        self.mitm = ssl.create_default_context(cafile=str(gw.ca_cert))
        self.upstream = ssl.create_default_context(cafile=str(ca.cert_path))

    def connect(self, host: str) -> socket.socket:
        return open_tunnel(self.address, f"{host}:443", self.token)

    @staticmethod
    def exchange(tls: ssl.SSLSocket, request: bytes) -> bytes:
        tls.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = tls.recv(65536)
            assert chunk, "closed mid-head"
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        fields = [line.lower() for line in head.split(b"\r\n")[1:]]
        if b"transfer-encoding: chunked" in fields:  # (a key swap's answer: re-framed)
            while not body.endswith(b"0\r\n\r\n"):
                body += tls.recv(65536)
            return head
        length = next(int(line.split(b":")[1]) for line in fields
                      if line.startswith(b"content-length:"))
        while len(body) < length:
            body += tls.recv(65536)
        return head

    def intercepted(self) -> None:
        with self.mitm.wrap_socket(self.connect("inspect.test"),
                                   server_hostname="inspect.test") as tls:
            for _ in range(5):
                head = self.exchange(tls, b"GET /small HTTP/1.1\r\nHost: inspect.test\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), head

    def injected(self) -> None:
        """The key swap (the token in the sandbox's key variable, the key sent on)."""
        with self.mitm.wrap_socket(self.connect("inspect.test"),
                                   server_hostname="inspect.test") as tls:
            for _ in range(5):
                head = self.exchange(tls, b"GET /small HTTP/1.1\r\nHost: inspect.test\r\n"
                                          b"Authorization: Bearer " + self.token.encode()
                                          + b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), head

    def refused_request(self) -> None:
        with self.mitm.wrap_socket(self.connect("inspect.test"),
                                   server_hostname="inspect.test") as tls:
            for _ in range(3):
                head = self.exchange(tls, b"DELETE /small HTTP/1.1\r\n"
                                          b"Host: inspect.test\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 403"), head

    def abandoned(self) -> None:
        """A download the client closes halfway (the gateway's writes then fail)."""
        tls = self.mitm.wrap_socket(self.connect("inspect.test"), server_hostname="inspect.test")
        tls.sendall(b"GET /big HTTP/1.1\r\nHost: inspect.test\r\n\r\n")
        tls.recv(65536)
        tls.close()

    def passthrough(self) -> None:
        with self.upstream.wrap_socket(self.connect("pass.test"),
                                       server_hostname="pass.test") as tls:
            head = self.exchange(tls, b"GET /small HTTP/1.1\r\nHost: pass.test\r\n"
                                      b"Connection: close\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head

    def refused_connect(self) -> None:
        with pytest.raises(ConnectionRefusedError, match="403"):
            self.connect("elsewhere.test").close()


def _left_in_cycles(gw: GatewayThread, run: Callable[[], None], times: int) -> Counter[str]:
    """What of the gateway's the collector found unreachable while `run` ran `times`."""
    for _ in range(3):
        run()  # (caches, pools and certificates filled first)
    gw.settle()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(times):
            run()
        gw.settle()
        time.sleep(0.3)  # (the last connections' ends, on the gateway's loop)
        gc.collect()
        left = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return Counter({k: n for k, n in left.items()
                    if k.startswith("gateway.") or k.startswith("asyncio.")})


# The suite's policy with a key swapped on inspect.test (for requests carrying the token).
KEYED = """
version: v1
name: agent
egress:
  - host: pass.test
  - host: inspect.test
    methods: [GET, HEAD, POST]
    credential: key
credentials:
  key: {hosts: [inspect.test], secret: cycles-key, inject: {bearer: true}}
"""


@pytest.mark.parametrize("kind", ["intercepted", "injected", "refused_request",
                                  "abandoned", "passthrough", "refused_connect"])
def test_a_connection_leaves_no_reference_cycle(make_gateway: GatewayFactory, nginx: Nginx,
                                                test_ca: LocalCA, kind: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """On the gateway's own engines (the front door, the HTTP/1 engine, the splice).
    mitmproxy, which serves HTTP/2, keeps each connection's flows and layers in cycles of
    its own (~3,000 objects a connection, measured): not counted here."""
    monkeypatch.setenv("SANDBOX_GATEWAY_SECRET_CYCLES_KEY", "sk-cycles-0123456789abcdef")
    gw = make_gateway(nginx.port, *([KEYED] if kind == "injected" else []))
    client = Client(gw, test_ca)
    left = _left_in_cycles(gw, getattr(client, kind), 20)
    assert left == Counter(), left
