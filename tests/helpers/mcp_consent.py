"""A person completing an MCP OAuth consent, as their browser would (for tests whose
authorization server is a local upstream serving every name on one port): the pending
consent's authorization URL opened over verified TLS (the name sent as SNI and Host, the
test CA trusted), its redirect followed to the gateway's callback."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from helpers.approvals import admin_api
from helpers.clients import read_head
from helpers.gateway import GatewayThread


def open_at(url: str, port: int, cafile: Path) -> tuple[int, dict[str, str]]:
    """GET `url` (https) at 127.0.0.1:`port` as its host: (status, headers)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    context = ssl.create_default_context(cafile=str(cafile))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname=host) as tls:
        tls.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
                    .encode())
        data = read_head(tls, 65536)
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in head[1:] if ": " in line)
    return int(head[0].split()[1]), {k.lower(): v for k, v in headers.items()}


@contextlib.contextmanager
def consenting(gw: GatewayThread, port: int, cafile: Path) -> Iterator[None]:
    """While the block runs, a person completes the first MCP OAuth consent asked (the
    authorization server at 127.0.0.1:`port`); on leaving, that it was completed."""
    done: list[str] = []

    def person() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            asked = [a for a in admin_api(gw, "GET", "/v1/approvals")["approvals"]
                     if a["state"] == "pending" and a["asked"]["kind"] == "oauth"]
            if asked:
                status, headers = open_at(asked[0]["consent"]["url"], port, cafile)
                assert status == 302, status
                back = httpx.get(headers["location"], timeout=20)
                done.append(f"{back.status_code} {back.text[:200]}")
                return
            time.sleep(0.05)
        done.append("no consent asked")

    thread = threading.Thread(target=person, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(40)
    assert done and done[0].startswith("200") and "Consent completed" in done[0], done
