"""The client for token endpoints: network.resolve, public roots + upstream_ca, timeouts,
bounded replies; failures are MintFailed with fixed sentences."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes.tlsserver import FakeServer, Reply, Request, json_reply

from gateway.services.minting import MintFailed, TokenHttp
from gateway.services.minting.http import MAX_REPLY

NAME = "tokens.example.test"


class Endpoint(FakeServer):
    def handle(self, request: Request) -> Reply:
        if request.path == "/big":
            return Reply(200, b"x" * (MAX_REPLY + 10))
        return json_reply(200, {"host": request.host, "body": request.body.decode()})


@pytest.fixture
def endpoint(tmp_path: Path) -> Iterator[Endpoint]:
    with Endpoint(tmp_path, [NAME]) as server:
        assert isinstance(server, Endpoint)
        yield server


def _run(http: TokenHttp, url: str, data: bytes | None = None) -> object:
    async def go() -> object:
        try:
            return await http.request("POST", url, data=data)
        finally:
            await http.close()

    return asyncio.run(go())


def test_resolve_override_and_upstream_ca(endpoint: Endpoint) -> None:
    http = TokenHttp(upstream_ca=endpoint.ca_path,
                     overrides={NAME: ("127.0.0.1", endpoint.port)})
    reply = _run(http, f"https://{NAME}/token", b"grant_type=x")
    assert reply.status == 200  # type: ignore[attr-defined]
    assert reply.json() == {"host": NAME, "body": "grant_type=x"}  # type: ignore[attr-defined]


def test_an_untrusted_certificate_is_refused(endpoint: Endpoint) -> None:
    http = TokenHttp(overrides={NAME: ("127.0.0.1", endpoint.port)})  # public roots only
    with pytest.raises(MintFailed) as info:
        _run(http, f"https://{NAME}/token")
    assert "not trusted" in str(info.value) and "network.upstream_ca" in str(info.value)


def test_an_oversized_reply_is_refused(endpoint: Endpoint) -> None:
    http = TokenHttp(upstream_ca=endpoint.ca_path,
                     overrides={f"{NAME}:443": ("127.0.0.1", endpoint.port)})
    with pytest.raises(MintFailed) as info:
        _run(http, f"https://{NAME}/big")
    assert "more than" in str(info.value)


def test_a_silent_endpoint_times_out() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]),
                     daemon=True).start()
    http = TokenHttp(overrides={NAME: ("127.0.0.1", listener.getsockname()[1])},
                     timeout=0.5)
    with pytest.raises(MintFailed) as info:
        _run(http, f"https://{NAME}/token")
    assert "did not answer within 0.5s" in str(info.value) and info.value.transient
    listener.close()
    for conn in accepted:
        conn.close()
