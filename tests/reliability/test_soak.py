"""Soak: a gateway process under mixed load for SOAK_SECONDS after a 15-second warm-up
(30 s in the suite — 45 s of load with the warm-up; 600 with `make soak`) must end
as it started — file descriptors back to the baseline, memory flat, every finished
exchange audited (issue 11, item 9).

The mix is what a fleet of agents does: keep-alive intercepted requests, one-shot
passthrough tunnels, refusals, downloads abandoned halfway, tunnels opened and left idle,
TLS handshakes cut short.
"""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.nginx import Nginx
from helpers.process import GatewayProcess, start_gateway
from helpers.tls import LocalCA

SECONDS = float(os.environ.get("SOAK_SECONDS", "30"))
WARM = 15.0  # the same mix first, unmeasured: what fills in the first seconds is not a leak
IDLE = 2.0  # client_idle and handshake: abandoned connections end this fast


@pytest.fixture
def gateway(tmp_path: Path, nginx: Nginx, test_ca: LocalCA) -> Iterator[GatewayProcess]:
    gw = start_gateway(tmp_path / "gw", {"inspect.test": nginx.port, "pass.test": nginx.port},
                       test_ca, extra={"network": {"timeouts": {"client_idle": f"{IDLE}s",
                                                                 "handshake": f"{IDLE}s"}}})
    yield gw
    gw.stop()


class Load:
    """Client loops on threads; each counts what it saw by outcome."""

    def __init__(self, gw: GatewayProcess, ca: LocalCA) -> None:
        self.gw = gw
        self.cred = base64.b64encode(f"sbx-1:{gw.token()}".encode()).decode()
        self.mitm_ctx = ssl.create_default_context(cafile=str(gw.workdir / "certs" / "ca.crt"))
        self.upstream_ctx = ssl.create_default_context(cafile=str(ca.cert_path))
        self.stop = threading.Event()
        self.seen: Counter[str] = Counter()
        self.lock = threading.Lock()

    def count(self, what: str) -> None:
        with self.lock:
            self.seen[what] += 1

    def connect(self, host: str) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.gw.proxy), timeout=10)
        sock.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nProxy-Authorization: Basic {self.cred}"
                     "\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(1)
            if not chunk:
                raise ConnectionError("closed before the CONNECT answer")
            head += chunk
        if not head.startswith(b"HTTP/1.1 200"):
            sock.close()
            raise PermissionError(head.split(b"\r\n", 1)[0].decode())
        return sock

    @staticmethod
    def response(tls: ssl.SSLSocket) -> bytes:
        """One whole response with a Content-Length (nginx's static files)."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = tls.recv(65536)
            if not chunk:
                raise ConnectionError("closed mid-head")
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            chunk = tls.recv(65536)
            if not chunk:
                raise ConnectionError("closed mid-body")
            body += chunk
        return head

    def keepalive_intercepted(self) -> None:
        with self.mitm_ctx.wrap_socket(self.connect("inspect.test"),
                                       server_hostname="inspect.test") as tls:
            for _ in range(20):
                tls.sendall(b"GET /small HTTP/1.1\r\nHost: inspect.test\r\n\r\n")
                assert self.response(tls).startswith(b"HTTP/1.1 200")
                self.count("intercepted")

    def passthrough_once(self) -> None:
        with self.upstream_ctx.wrap_socket(self.connect("pass.test"),
                                           server_hostname="pass.test") as tls:
            tls.sendall(b"GET /small HTTP/1.1\r\nHost: pass.test\r\nConnection: close\r\n\r\n")
            assert self.response(tls).startswith(b"HTTP/1.1 200")
        self.count("passthrough")

    def refused(self) -> None:
        with contextlib.suppress(PermissionError):
            self.connect("elsewhere.test").close()
            raise AssertionError("elsewhere.test was let through")
        self.count("refused")

    def abandoned_download(self) -> None:
        tls = self.mitm_ctx.wrap_socket(self.connect("inspect.test"),
                                        server_hostname="inspect.test")
        tls.sendall(b"GET /big HTTP/1.1\r\nHost: inspect.test\r\n\r\n")
        tls.recv(65536)
        tls.close()  # halfway through 1 MiB
        self.count("abandoned")

    def left_idle(self) -> None:
        with self.connect("pass.test") as sock:  # never used: the idle timeout ends it
            sock.settimeout(IDLE * 3)
            assert sock.recv(1) == b"", "the gateway kept an idle tunnel open"
        self.count("idle")

    def cut_handshake(self) -> None:
        sock = self.connect("inspect.test")
        sock.sendall(b"\x16\x03\x01\x00\x05\x01\x00")  # a truncated ClientHello
        sock.close()
        self.count("cut")

    def loop(self, step: Callable[[], None], pause: float) -> None:
        while not self.stop.is_set():
            try:
                step()
            except (OSError, AssertionError, ValueError) as exc:
                self.count(f"error {step.__name__}: {type(exc).__name__} {exc}"[:120])
            self.stop.wait(pause)

    def run(self, seconds: float, sample: Callable[[], None]) -> None:
        steps = [(self.keepalive_intercepted, 0.0), (self.keepalive_intercepted, 0.0),
                 (self.passthrough_once, 0.0), (self.refused, 0.05),
                 (self.abandoned_download, 0.1), (self.left_idle, 0.0),
                 (self.cut_handshake, 0.1)]
        threads = [threading.Thread(target=self.loop, args=step, daemon=True) for step in steps]
        for t in threads:
            t.start()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sample()
            time.sleep(1)
        self.stop.set()
        for t in threads:
            t.join(30)


@pytest.mark.slow
@pytest.mark.timeout(SECONDS + WARM + 120)
def test_soak_mixed_load_leaves_no_sockets_and_flat_memory(
        gateway: GatewayProcess, test_ca: LocalCA) -> None:
    warm = Load(gateway, test_ca)  # certificates minted, pools and caches filled
    warm.run(WARM, lambda: None)
    assert not [k for k in warm.seen if k.startswith("error")], warm.seen
    time.sleep(IDLE * 2 + 1)
    fds_before = gateway.fds()
    audited_before = len(gateway.audit_lines())
    load = Load(gateway, test_ca)
    samples: list[tuple[int, int]] = []
    load.run(SECONDS, lambda: samples.append((gateway.fds(), gateway.rss_kib())))

    errors = {k: v for k, v in load.seen.items() if k.startswith("error")}
    assert not errors, errors
    for kind in ("intercepted", "passthrough", "refused", "abandoned", "idle", "cut"):
        assert load.seen[kind] > 0, load.seen

    deadline = time.monotonic() + IDLE * 3 + 5  # idle tunnels, then the sweeper's tick
    while gateway.fds() > fds_before + 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    fds_after = gateway.fds()
    peak_fds = max(f for f, _ in samples)
    third = max(1, len(samples) // 3)
    # The floor the memory settles to once the load is over (what its connections held
    # freed, jemalloc's decay handing the pages back within a second or two), against the
    # floor of the measured run's first third: a leak raises the floor, a burst's memory
    # does not. (The RSS under load is a sawtooth of 30-40 MiB swings, one swing about as
    # long as the run: comparing the thirds' medians read a climb as growth, 92 -> 119
    # MiB on a busy CI machine with no leak.)
    settled = []
    for _ in range(10):
        settled.append(gateway.rss_kib())
        time.sleep(0.5)
    rss_floor = min(r for _, r in samples[:third])
    rss_settled = min(settled)
    print(f"\nsoak {SECONDS:.0f}s: {dict(load.seen)}; fds {fds_before} -> peak {peak_fds} -> "
          f"{fds_after}; RSS floor early {rss_floor / 1024:.0f} MiB, settled after the load "
          f"{rss_settled / 1024:.0f}; RSS MiB over time "
          f"{[r // 1024 for _, r in samples[::max(1, len(samples) // 10)]]}")
    assert fds_after <= fds_before + 2, (fds_before, fds_after)
    # (A leak of 4 KiB an exchange, 10,000-18,000 exchanges a run, is 40-70 MiB.)
    assert rss_settled - rss_floor < max(24 * 1024, rss_floor // 4), (rss_floor, rss_settled)

    audited = Counter(line.get("decision") for line in gateway.audit_lines()[audited_before:])
    # Every exchange and tunnel ends on an audit line.
    finished = load.seen["intercepted"] + load.seen["passthrough"]
    assert audited["allow"] >= finished, (audited, load.seen)
    assert audited["deny"] >= load.seen["refused"], (audited, load.seen)
