"""Memory that comes back (issue 46, item 3), on a real `sandbox-gateway run` process and
a real nginx: a burst of intercepted tunnels (CONNECT, TLS to the gateway's leaf, one
request each, all held open at once, then closed) leaves the worker within 1.5x its idle
RSS within a minute; and with `limits.memory` the worker refuses new connections
`503 at_capacity` (audited, /readyz 503) while its RSS is above the ceiling, and takes
them again once the burst has closed.

The burst is the issue's 5,000 tunnels (`MEMORY_BURST`; `MEMORY_ROUNDS` rounds): the test
takes the time to open them (the client's and the gateway's TLS handshakes; 214 s once
with 2 vCPU saturated by other jobs), then ends as soon as the RSS is back under 1.5x (1 s
after they closed, measured). On the gateway's default allocator: jemalloc where
libjemalloc2 is installed (gateway/runtime/allocator.py; the test checks the process
runs on it), which leaves 1.16-1.22x. CPython's own allocator (pymalloc) leaves
1.65-1.69x: its 1 MiB arenas stay pinned by a few hundred long-lived objects
(gateway/runtime/memory.py); `MEMORY_PYTHONMALLOC=pymalloc` starts the gateway that way
(this test then fails at 5,000, as it should). `make soak` runs three rounds.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import resource
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.nginx import Nginx
from helpers.process import GatewayProcess, start_gateway
from helpers.tls import LocalCA

from gateway.runtime.allocator import find_jemalloc

TUNNELS = int(os.environ.get("MEMORY_BURST", "5000"))
ROUNDS = int(os.environ.get("MEMORY_ROUNDS", "1"))
PYTHONMALLOC = os.environ.get("MEMORY_PYTHONMALLOC", "")  # the gateway's allocator, if set
JEMALLOC = find_jemalloc()  # (the default where installed)
RATIO = 1.5  # the RSS a burst may leave, over the idle RSS
WITHIN = 60.0  # seconds after the burst closed
MIB = 1024


@pytest.fixture(autouse=True)
def _descriptors() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = TUNNELS * 3 + 1024  # the client's sockets, the gateway's two per tunnel
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"needs an open-files hard limit of {need} (have {hard})")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


@pytest.fixture
def upstream(tmp_path: Path, test_ca: LocalCA) -> Iterator[Nginx]:
    server = Nginx(tmp_path / "nginx", test_ca, ["inspect.test"])
    yield server
    server.stop()


def _gateway(tmp_path: Path, upstream: Nginx, ca: LocalCA,
             limits: dict[str, object] | None = None) -> GatewayProcess:
    return start_gateway(tmp_path, {"inspect.test": upstream.port}, ca, extra={
        "limits": {"connections_per_sandbox": 100_000, **(limits or {})}},
        log=tmp_path.parent / f"{tmp_path.name}.log")


class Tunnels:
    """Intercepted tunnels through the gateway, opened together and held."""

    def __init__(self, gw: GatewayProcess) -> None:
        self.gw = gw
        self.cred = base64.b64encode(f"sbx-1:{gw.token()}".encode()).decode()
        self.tls = ssl.create_default_context(cafile=str(gw.workdir / "certs" / "ca.crt"))
        self.writers: list[asyncio.StreamWriter] = []
        self.refused: list[bytes] = []

    async def one(self) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.gw.proxy)
        try:
            writer.write(f"CONNECT inspect.test:443 HTTP/1.1\r\nProxy-Authorization: Basic "
                         f"{self.cred}\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                self.refused.append(head)
                writer.close()
                await writer.wait_closed()
                return
            await writer.start_tls(self.tls, server_hostname="inspect.test")
            writer.write(b"GET /small HTTP/1.1\r\nHost: inspect.test\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            await reader.readexactly(100)
        except BaseException:
            writer.close()
            raise
        self.writers.append(writer)

    async def open(self, count: int, *, at_once: int = 200) -> None:
        """`count` tunnels, `at_once` being set up at a time (all stay open)."""
        room = asyncio.Semaphore(at_once)

        async def guarded() -> None:
            async with room:
                await self.one()

        await asyncio.gather(*(guarded() for _ in range(count)))

    async def close(self) -> None:
        writers, self.writers = self.writers, []
        for writer in writers:
            writer.close()
        for writer in writers:
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()


def _settled_rss(gw: GatewayProcess, seconds: float = 3.0) -> int:
    """The RSS once it stops moving (KiB)."""
    time.sleep(seconds)
    return gw.rss_kib()


def _readyz(gw: GatewayProcess) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{gw.admin}/readyz", timeout=5) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.slow
@pytest.mark.timeout(300 + 240 * ROUNDS)  # (opening 5,000 on 2 saturated vCPU: 214 s)
def test_a_burst_of_intercepted_tunnels_gives_its_memory_back(
        tmp_path: Path, upstream: Nginx, test_ca: LocalCA,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if PYTHONMALLOC:  # (the gateway inherits it; this process has started already)
        monkeypatch.setenv("PYTHONMALLOC", PYTHONMALLOC)
    gw = _gateway(tmp_path / "gw", upstream, test_ca)
    try:
        async def warm() -> None:  # leaf certificate minted, first imports done
            tunnels = Tunnels(gw)
            await tunnels.open(20)
            await tunnels.close()

        asyncio.run(warm())
        on_jemalloc = "libjemalloc" in Path(f"/proc/{gw.proc.pid}/maps").read_text()
        if not PYTHONMALLOC and JEMALLOC is not None:  # `run` started itself on it
            assert on_jemalloc, "the gateway does not run on the installed jemalloc"
        idle = _settled_rss(gw)
        allocator = PYTHONMALLOC or ("jemalloc" if on_jemalloc else "pymalloc")
        report = [f"idle {idle // MIB} MiB ({allocator})"]
        for round_ in range(ROUNDS):
            async def burst() -> int:
                tunnels = Tunnels(gw)
                await tunnels.open(TUNNELS)
                assert not tunnels.refused, tunnels.refused[:1]
                peak = gw.rss_kib()
                await tunnels.close()
                return peak

            opened = time.monotonic()
            peak = asyncio.run(burst())
            closed = time.monotonic()
            samples = []
            while True:
                rss = gw.rss_kib()
                samples.append(rss // MIB)
                if rss <= idle * RATIO or time.monotonic() - closed > WITHIN:
                    break
                time.sleep(1)
            took = time.monotonic() - closed
            report.append(f"round {round_ + 1}: {TUNNELS} tunnels in {closed - opened:.0f} s, "
                          f"peak {peak // MIB} MiB, "
                          f"{rss // MIB} MiB ({rss / idle:.2f}x) {took:.0f} s after they "
                          f"closed")
            print("\nmemory: " + "; ".join(report))
            assert rss <= idle * RATIO, (report, samples)
        assert "Traceback" not in (tmp_path / "gw.log").read_text()
    finally:
        gw.stop()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_above_limits_memory_new_connections_are_refused_until_it_comes_back(
        tmp_path: Path, upstream: Nginx, test_ca: LocalCA) -> None:
    probe = _gateway(tmp_path / "probe", upstream, test_ca)
    try:
        idle = _settled_rss(probe, 1.0)
    finally:
        probe.stop()
    ceiling = idle // MIB + 48  # MiB: reached with several hundred open tunnels
    gw = _gateway(tmp_path / "gw", upstream, test_ca, {"memory": f"{ceiling}MiB"})
    try:
        async def scenario() -> None:
            tunnels = Tunnels(gw)
            try:
                await above(tunnels)
            finally:  # (held tunnels closed even when a check fails: none left to the GC)
                await tunnels.close()
            deadline = time.monotonic() + 30
            while _readyz(gw)[0] != 200 and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            assert _readyz(gw)[0] == 200, (gw.rss_kib() // MIB, ceiling)
            more = Tunnels(gw)
            await more.open(5)
            assert not more.refused, more.refused[:1]
            await more.close()

        async def above(tunnels: Tunnels) -> None:
            for _ in range(40):  # 100 more at a time until the gateway refuses
                await tunnels.open(100, at_once=50)
                if tunnels.refused:
                    break
            assert tunnels.refused, f"never refused: {gw.rss_kib() // MIB} MiB, {ceiling} MiB"
            head = tunnels.refused[0]
            assert head.startswith(b"HTTP/1.1 503 at_capacity"), head
            assert b"Proxy-Status: " in head and b"limits.memory" in head, head
            assert gw.rss_kib() > ceiling * MIB
            status, reason = _readyz(gw)
            # (above the ceiling the guard releases memory once a second: it may be below
            # again, and ready, by the time /readyz is asked; its log then says so)
            if status == 200:
                deadline = time.monotonic() + 5
                while "below limits.memory" not in (tmp_path / "gw.log").read_text():
                    assert time.monotonic() < deadline, reason
                    await asyncio.sleep(0.1)
            else:
                assert status == 503 and "limits.memory" in reason, (status, reason)
            refusals = [line for line in gw.audit_lines() if line.get("error") == "at_capacity"]
            assert refusals and "limits.memory" in refusals[0]["reason"], refusals[:1]

        asyncio.run(scenario())
        # (the guard logs each crossing from its own check, which may follow the refusal
        # and the recovery the scenario saw by a moment on a loaded machine)
        deadline = time.monotonic() + 15
        log = (tmp_path / "gw.log").read_text()
        while not ("is above limits.memory" in log and "below limits.memory" in log) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
            log = (tmp_path / "gw.log").read_text()
        assert "is above limits.memory" in log and "below limits.memory" in log, log[-2000:]
        assert "Traceback" not in log
    finally:
        gw.stop()
