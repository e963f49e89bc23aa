"""Small real clients for tests: a raw CONNECT (to read refusal bodies, which curl and
httpx do not show for a refused tunnel) and curl with parsed status/headers."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any


def raw_connect(proxy: tuple[str, int], authority: str, token: str | None,
                sandbox: str = "sandbox-1") -> tuple[int, dict[str, str], dict[str, Any] | None]:
    """Send one CONNECT; return (status, headers, JSON body or None)."""
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
    if token is not None:
        cred = base64.b64encode(f"{sandbox}:{token}".encode()).decode()
        lines.append(f"Proxy-Authorization: Basic {cred}")
    with socket.create_connection(proxy, timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        head, _, body = read_head(sock, 65536).partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    status = int(status_line.split()[1])
    return status, headers, json.loads(body) if body.strip() else None


def read_head(sock: socket.socket, size: int) -> bytes:
    """Bytes read `size` at a time until a blank line (or EOF): `size` 1 leaves what
    follows the head unread (a tunnel's first bytes)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(size)
        if not chunk:
            break
        data += chunk
    return data


def open_tunnel(proxy: tuple[str, int], authority: str, token: str,
                sandbox: str = "sandbox-1", timeout: float = 10) -> socket.socket:
    """CONNECT authority and return the socket after a 200 answer (its head read byte by byte,
    so nothing of the tunnel is consumed); any other answer raises ConnectionRefusedError
    carrying the head."""
    sock = socket.create_connection(proxy, timeout=timeout)
    cred = base64.b64encode(f"{sandbox}:{token}".encode()).decode()
    sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n"
                 f"Proxy-Authorization: Basic {cred}\r\n\r\n".encode())
    head = read_head(sock, 1)
    if not head.startswith(b"HTTP/1.1 200"):
        sock.close()
        raise ConnectionRefusedError(f"CONNECT {authority}: {head.decode('latin-1')}")
    return sock


def curl(proxy: str, url: str, cacert: Path, *args: str) -> tuple[int, str, dict[str, str]]:
    """Run curl through `proxy`; (status of the last response, body, its headers)."""
    out = subprocess.run(
        ["curl", "-sS", "-D", "-", "--max-time", "10", "-x", proxy, "--cacert", str(cacert),
         *args, url], capture_output=True, text=True, timeout=20)
    text = out.stdout.replace("\r\n", "\n")
    blocks = text.split("\n\n")
    heads = [i for i, b in enumerate(blocks) if b.startswith("HTTP/")]
    if not heads:
        return 0, out.stderr, {}
    last = heads[-1]
    lines = blocks[last].split("\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:]) if v}
    return int(lines[0].split()[1]), "\n\n".join(blocks[last + 1:]), headers


def ended_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the connection ends (EOF, a reset, a TLS error), draining what still
    comes; None if it is still open after `seconds`. Plain and TLS sockets alike."""
    start = time.monotonic()
    sock.settimeout(0.05)
    while time.monotonic() - start < seconds:
        try:
            if not sock.recv(65536):
                return time.monotonic() - start
        except (TimeoutError, ssl.SSLWantReadError):
            continue
        except OSError:
            return time.monotonic() - start
    return None
