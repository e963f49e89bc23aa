"""The gateway as a real process: start-up safety, SIGTERM drain, bad input that must
not leave tracebacks (issue 11, items 4, 7, 8)."""

from __future__ import annotations

import base64
import signal
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.nginx import Nginx
from helpers.process import ADMIN, GatewayProcess, start_gateway
from helpers.tls import LocalCA

from gateway.engines.h1.pool import LIMIT as POOL_LIMIT


@pytest.fixture
def gateway(tmp_path: Path, nginx: Nginx, test_ca: LocalCA) -> Iterator[GatewayProcess]:
    gw = start_gateway(tmp_path / "a", {"inspect.test": nginx.port}, test_ca)
    yield gw
    gw.stop()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_second_instance_on_the_same_port_refuses_to_start(
        gateway: GatewayProcess, tmp_path: Path, nginx: Nginx, test_ca: LocalCA,
        workers: int) -> None:
    """SO_REUSEPORT let a second `run` share the ports silently (mixed policies answered,
    a revoked token passing on the other instance). Only one supervisor's workers may."""
    second = start_gateway(tmp_path / f"b{workers}", {"inspect.test": nginx.port}, test_ca,
                           proxy=gateway.proxy, workers=workers, wait=False)
    try:
        assert second.proc.wait(30) == 2
        assert f"cannot listen on 127.0.0.1:{gateway.proxy}" in second.stderr()
    finally:
        second.stop()


def test_sigterm_drains_a_stream_then_exits(gateway: GatewayProcess) -> None:
    token = gateway.token()
    sock = socket.create_connection(("127.0.0.1", gateway.proxy), timeout=10)
    cred = base64.b64encode(f"sbx-1:{token}".encode()).decode()
    sock.sendall(f"CONNECT inspect.test:443 HTTP/1.1\r\nProxy-Authorization: Basic {cred}"
                 "\r\n\r\n".encode())
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    tls = ssl.create_default_context(cafile=str(gateway.workdir / "certs" / "ca.crt")
                                     ).wrap_socket(sock, server_hostname="inspect.test")
    tls.sendall(b"GET /big HTTP/1.1\r\nHost: inspect.test\r\n\r\n")
    received = len(tls.recv(65536))
    gateway.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(OSError):  # the listener is closed: nothing new is accepted
        socket.create_connection(("127.0.0.1", gateway.proxy), timeout=2).recv(1)
    while received < 1024 * 1024:
        chunk = tls.recv(65536)
        assert chunk, f"cut at {received}"
        received += len(chunk)
        time.sleep(0.002)
    tls.close()
    assert gateway.proc.wait(15) == 0
    err = gateway.stderr()
    assert "draining" in err and "Traceback" not in err


def test_bad_input_is_a_4xx_never_a_traceback(gateway: GatewayProcess) -> None:
    """Non-ASCII proxy credentials answered 500 with a traceback per request (a sandbox
    could flood the logs); `CONNECT … HTTP/9.9` was accepted; malformed chunked bodies on
    the admin API logged tracebacks."""
    answers = []
    for raw in (b"CONNECT inspect.test:443 HTTP/1.1\r\nProxy-Authorization: Basic \xff\xfe\r\n\r\n",
                b"CONNECT inspect.test:443 HTTP/9.9\r\n\r\n",
                b"\x16\x03\x01garbage\r\n\r\n",
                b"GET http://inspect.test/ HTTP/1.1\r\nHost: inspect.test\r\n"
                b"Proxy-Authorization: Bearer \xc3\x28\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", gateway.proxy), timeout=5) as s:
            s.sendall(raw)
            answers.append(s.recv(65536).split(b"\r\n", 1)[0])
    assert answers[0].startswith(b"HTTP/1.1 407 token_malformed"), answers
    assert answers[1].startswith(b"HTTP/1.1 400 bad_request"), answers
    assert answers[2].startswith(b"HTTP/1.1 400 bad_request"), answers
    assert answers[3].startswith(b"HTTP/1.1 407"), answers
    with socket.create_connection(("127.0.0.1", gateway.admin), timeout=5) as s:
        s.sendall(f"POST /v1/tokens HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n"
                  "Transfer-Encoding: chunked\r\n\r\nzz\r\nnot chunked\r\n\r\n".encode())
        assert s.recv(65536).split(b" ")[1].startswith(b"4")
    gateway.proc.send_signal(signal.SIGTERM)
    err = gateway.stderr()
    assert "Traceback" not in err, err[-3000:]
    assert err.count("\n") < 15, err  # the banner, a warning or two: no per-request noise


def test_running_out_of_descriptors_refuses_then_recovers(
        tmp_path: Path, nginx: Nginx, test_ca: LocalCA) -> None:
    """Under `ulimit -n 1024` the accept loop used to fail with EMFILE after ~500 tunnels,
    every sandbox got nothing, /readyz stayed 200 and it never recovered. Now the cap
    derived from the limit answers 503 at_capacity, /readyz says why, and closing the
    tunnels brings it all back."""
    gw = start_gateway(tmp_path / "gw", {"pass.test": nginx.port}, test_ca, fd_limit=256)
    try:
        token = gw.token()
        cred = base64.b64encode(f"sbx-1:{token}".encode()).decode()
        upstream = ssl.create_default_context(cafile=str(test_ca.cert_path))

        def tunnel() -> tuple[socket.socket, bytes]:
            sock = socket.create_connection(("127.0.0.1", gw.proxy), timeout=10)
            sock.sendall(f"CONNECT pass.test:443 HTTP/1.1\r\nProxy-Authorization: Basic "
                         f"{cred}\r\n\r\n".encode())
            return sock, sock.recv(4096)

        def readyz() -> int:
            try:
                return int(urllib.request.urlopen(f"http://127.0.0.1:{gw.admin}/readyz",
                                                  timeout=5).status)
            except urllib.error.HTTPError as exc:
                return exc.code

        open_tunnels: list[socket.socket] = []
        pool = min(POOL_LIMIT, (256 - 64) // 8)  # kept for upstream connections
        capacity = (256 - 64 - pool) // 2  # (limit - reserve - pool) / 2 per tunnel
        for _ in range(capacity):
            sock, head = tunnel()
            assert head.startswith(b"HTTP/1.1 200"), head
            tls = upstream.wrap_socket(sock, server_hostname="pass.test")  # upstream dialled
            open_tunnels.append(tls)
        sock, head = tunnel()
        sock.close()
        assert head.startswith(b"HTTP/1.1 503 at_capacity"), head
        assert b"open-files limit" in head
        assert readyz() == 503
        for tls in open_tunnels:
            tls.close()
        deadline = time.monotonic() + 10
        while readyz() != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert readyz() == 200
        sock, head = tunnel()
        with upstream.wrap_socket(sock, server_hostname="pass.test") as tls:
            tls.sendall(b"GET /small HTTP/1.1\r\nHost: pass.test\r\nConnection: close\r\n\r\n")
            assert tls.recv(4096).startswith(b"HTTP/1.1 200")
        gw.proc.send_signal(signal.SIGTERM)
        assert "Traceback" not in gw.stderr()
    finally:
        gw.stop()
