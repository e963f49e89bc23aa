"""Passthrough tunnels end: closed, audited and counted down when both directions end.

The clients here close the way real ones do against nginx: curl sends close_notify
and FIN, `requests` closes the socket without close_notify. Before the fix every such
tunnel kept both sockets open forever (no audit line until shutdown).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import requests
from helpers.gateway import GatewayThread
from helpers.nginx import Nginx
from helpers.tls import LocalCA

from gateway.engines.relay_native import AVAILABLE as NATIVE
from gateway.engines.relay_native import NativeRelay
from gateway.engines.splice_kernel import KernelRelay

ROUNDS = 30
# the relay thread's own descriptors (its epoll and two eventfds), held from the first
# tunnel to shutdown like the loop's epoll: a per-tunnel leak shows as ROUNDS more
RELAYER_FDS = 3 if NATIVE else 0
NAMES = ["pass.test", "inspect.test"]  # (the names the conftest's gateways resolve)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _open_connections(gw: GatewayThread) -> float:
    text = urllib.request.urlopen(gw.admin + "/metrics", timeout=5).read().decode()
    match = re.search(r"^sandbox_gateway_open_connections (\S+)$", text, re.M)
    assert match is not None
    return float(match.group(1))


def _settle(gw: GatewayThread, want_lines: int, fds_before: int, gauge_before: float) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = gw.audit.records()
        done = [r for r in lines if r["path_taken"] == "passthrough"]
        if len(done) >= want_lines and _fds() <= fds_before + 2 + RELAYER_FDS \
                and _open_connections(gw) == gauge_before:
            return
        time.sleep(0.05)
    done = [r for r in gw.audit.records() if r["path_taken"] == "passthrough"]
    raise AssertionError(f"after {want_lines} tunnels: {len(done)} audit lines, "
                         f"fds {fds_before} -> {_fds()}, open_connections "
                         f"{gauge_before} -> {_open_connections(gw)}")


def test_curl_tunnels_close_when_both_sides_end(make_gateway, nginx: Nginx,
                                                test_ca: LocalCA) -> None:
    gw: GatewayThread = make_gateway(nginx.port)
    token = gw.mint("agent")
    gauge, fds = _open_connections(gw), _fds()
    for _ in range(ROUNDS):
        out = subprocess.run(
            ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert",
             str(test_ca.cert_path), "-x", gw.proxy_url(token), "https://pass.test/small"],
            capture_output=True, text=True, timeout=20, check=True)
        assert out.stdout == "200"
    _settle(gw, ROUNDS, fds, gauge)
    lines = [r for r in gw.audit.records() if r["path_taken"] == "passthrough"]
    assert all(r["bytes_in"] > 100 and r["bytes_out"] > 0 and r["status"] == 200
               for r in lines)


def test_requests_without_close_notify_free_their_sockets(make_gateway, nginx: Nginx,
                                                          test_ca: LocalCA) -> None:
    gw: GatewayThread = make_gateway(nginx.port)
    token = gw.mint("agent")
    proxies = {"https": gw.proxy_url(token)}
    gauge, fds = _open_connections(gw), _fds()
    for _ in range(ROUNDS):
        with requests.Session() as session:
            status = session.get("https://pass.test/small", proxies=proxies,
                                 verify=str(test_ca.cert_path), timeout=10).status_code
            assert status == 200
    _settle(gw, ROUNDS, fds, gauge)



def test_a_bulk_download_is_relayed_by_the_kernel_whole_and_audited(
        make_gateway, test_ca: LocalCA, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A direct passthrough tunnel goes to the kernel relay (splice(2) through a pipe;
    on the native relay thread where it is built): 32 MiB arrive byte for byte, the
    audit line counts them, and the tunnel ends with nothing left open."""
    kind: type[KernelRelay] | type[NativeRelay] = NativeRelay if NATIVE else KernelRelay
    started: list[KernelRelay | NativeRelay] = []
    original = kind.start

    def start(self: KernelRelay | NativeRelay, *, client_ended: bool = False) -> None:
        started.append(self)
        original(self, client_ended=client_ended)  # type: ignore[arg-type]

    monkeypatch.setattr(kind, "start", start)
    size = 32 * 1024 * 1024
    server = Nginx(tmp_path / "nginx", test_ca, NAMES, big=size)
    try:
        gw: GatewayThread = make_gateway(server.port)
        token = gw.mint("agent")
        gauge, fds = _open_connections(gw), _fds()
        out = subprocess.run(
            ["curl", "-sS", "-o", "-", "--cacert", str(test_ca.cert_path),
             "-x", gw.proxy_url(token), "https://pass.test/big"],
            capture_output=True, timeout=60, check=True)
        assert hashlib.sha256(out.stdout).digest() == hashlib.sha256(
            bytes(range(256)) * (size // 256)).digest()
        _settle(gw, 1, fds, gauge)
    finally:
        server.stop()
    assert len(started) == 1
    [line] = [r for r in gw.audit.records() if r["path_taken"] == "passthrough"]
    assert line["bytes_in"] > size and line["bytes_out"] > 0, line
    assert line["bytes_in"] == started[0].bytes_in  # (bytes_out: the hello came first)
