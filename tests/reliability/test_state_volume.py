"""The state volume filling up (issue 46, item 2), on a real gateway process whose
SQLite state lives on a real 96 MiB tmpfs: the console's request log is a file of its
own with a bound; as the volume gets short (another file takes it below 64 MiB free)
`/readyz` warns within the volume's reading interval (`state.volume_check`, 1 s here)
while staying ready, the metrics say how much is free and how big the files are, the
request log stops growing, and revocations are written throughout; when space returns
the warning clears within the interval too."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.disk import tiny_tmpfs
from helpers.nginx import Nginx
from helpers.process import ADMIN, GatewayProcess, start_gateway
from helpers.tls import LocalCA

from gateway.services.state.sqlite_log import log_path

MIB = 1024 * 1024
CHECK = 1  # seconds: state.volume_check
NOTICED = CHECK + 5  # seconds: /readyz has followed a change of the volume (its reading, slack)


@pytest.fixture
def volume(tmp_path: Path) -> Iterator[Path]:
    yield from tiny_tmpfs(tmp_path / "volume", "96m")


def _get(gw: GatewayProcess, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{gw.admin}{path}", timeout=5) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _revoke(gw: GatewayProcess, jti: str) -> int:
    req = urllib.request.Request(
        f"http://127.0.0.1:{gw.admin}/v1/tokens/revoke", method="POST",
        data=json.dumps({"jti": jti}).encode(),
        headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _requests(gw: GatewayProcess, count: int) -> None:
    """`count` intercepted requests on one keep-alive tunnel (an audit line each)."""
    cred = base64.b64encode(f"sbx-1:{gw.token()}".encode()).decode()
    ctx = ssl.create_default_context(cafile=str(gw.workdir / "certs" / "ca.crt"))
    sock = socket.create_connection(("127.0.0.1", gw.proxy), timeout=10)
    sock.sendall(f"CONNECT inspect.test:443 HTTP/1.1\r\nProxy-Authorization: Basic {cred}"
                 "\r\n\r\n".encode())
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    with ctx.wrap_socket(sock, server_hostname="inspect.test") as tls:
        for n in range(count):
            tls.sendall(f"GET /small?n={n} HTTP/1.1\r\nHost: inspect.test\r\n\r\n".encode())
            data = b""
            while not data.endswith(b"s" * 99 + b"\n"):
                chunk = tls.recv(65536)
                assert chunk, "closed"
                data += chunk


def _metric(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name)]
    assert lines, name
    return float(lines[0].split()[-1])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_filling_state_volume_is_warned_of_and_never_stops_revocations(
        tmp_path: Path, volume: Path, nginx: Nginx, test_ca: LocalCA) -> None:
    state = volume / "state" / "gateway.db"
    gw = start_gateway(tmp_path / "gw", {"inspect.test": nginx.port}, test_ca, extra={
        "state": {"store": "sqlite", "path": str(state), "volume_check": f"{CHECK}s"},
        "audit": {"spill": {"max": 0}}}, log=tmp_path / "gw.log")
    try:
        status, body = _get(gw, "/readyz")
        assert status == 200 and "state volume" not in body, body
        _requests(gw, 300)
        metrics = _get(gw, "/metrics")[1]
        assert _metric(metrics, "sandbox_gateway_state_volume_free_bytes") > 64 * MIB
        assert _metric(metrics, 'sandbox_gateway_state_file_bytes{file="state"}') > 0

        filler = volume / "filler"
        filler.write_bytes(b"\0" * (40 * MIB))  # another tenant of the volume
        deadline = time.monotonic() + NOTICED
        while "state volume" not in _get(gw, "/readyz")[1] and time.monotonic() < deadline:
            time.sleep(0.5)
        status, body = _get(gw, "/readyz")
        assert status == 200 and "MiB free of" in body and "request log no longer grows" \
            in body, body
        assert _metric(_get(gw, "/metrics")[1],
                       "sandbox_gateway_state_volume_free_bytes") < 64 * MIB
        held = log_path(state).stat().st_size
        _requests(gw, 1500)  # lines go on replacing the oldest: the file does not grow
        time.sleep(0.5)  # (the last batch)
        assert log_path(state).stat().st_size <= held + 256 * 1024
        assert _revoke(gw, "jti-during") == 200
        assert "state store" not in _get(gw, "/readyz")[1]

        filler.unlink()
        deadline = time.monotonic() + NOTICED
        while "state volume" in _get(gw, "/readyz")[1] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _get(gw, "/readyz") == (200, '{"ready":true,"reason":"ready"}')
        log = (tmp_path / "gw.log").read_text()
        assert "the state volume has" in log and "MiB free again" in log
        assert "Traceback" not in log
    finally:
        gw.stop()
