"""The gateway as a real process: start-up safety, SIGTERM drain, bad input that must
not leave tracebacks (issue 11, items 4, 7, 8)."""

from __future__ import annotations

import base64
import signal
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.nginx import Nginx
from helpers.process import ADMIN, GatewayProcess, start_gateway
from helpers.tls import LocalCA


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
