"""Checked and pinned resolution: DestinationGuard, pin(), GuardedEventLoop, backstop.

Nothing here leaves the machine: names map to 127.0.0.x canaries (listeners that record
every connection) through StaticResolver, `socket.getaddrinfo` is replaced by a fake
that knows only `localhost` and numeric hosts, and "public" addresses are stood in for
by canaries opened with allow_cidrs (or trusted overrides, as network.resolve does).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from gateway.core.addresses import AddressPolicy
from gateway.engines.mitm import REFUSED_MARK
from gateway.net.resolver import (
    BackstopRefused,
    DestinationGuard,
    DestinationRefused,
    GuardedEventLoop,
    GuardedEventLoopPolicy,
    Pinned,
    StaticResolver,
    SystemResolver,
    current_pin,
    install_backstop,
    installed_backstop,
    local_interface_addresses,
    mark_upstream,
    new_event_loop,
    parse_overrides,
    pin,
    unguarded,
    uninstall_backstop,
    unpin,
)

# ----------------------------------------------------------------------------- helpers


class Canary:
    """A listener on 127.0.0.x that records connections and answers one HTTP response."""

    def __init__(self, ip: str, port: int = 0) -> None:
        self.ip = ip
        self.sock = socket.create_server((ip, port))
        self.sock.settimeout(0.05)
        self.port: int = self.sock.getsockname()[1]
        self.hits: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.hits.append(peer)
            with conn:
                conn.settimeout(2)
                data = b""
                with contextlib.suppress(OSError):
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        data += chunk
                    body = f"canary {self.ip}".encode()
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: "
                        + str(len(body)).encode() + b"\r\n\r\n" + body
                    )

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(2)


@pytest.fixture
def canaries() -> Iterator[dict[str, Canary]]:
    """Canaries on 127.0.0.1, .2 and .3, all on the same port."""
    for _ in range(20):
        opened: list[Canary] = []
        try:
            first = Canary("127.0.0.1")
            opened.append(first)
            for ip in ("127.0.0.2", "127.0.0.3"):
                opened.append(Canary(ip, first.port))
        except OSError:
            for c in opened:
                c.close()
            continue
        try:
            yield {c.ip: c for c in opened}
        finally:
            for c in opened:
                c.close()
        return
    pytest.fail("could not bind canaries")


@pytest.fixture(autouse=True)
def no_dns(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace socket.getaddrinfo: only `localhost` and numeric hosts; record names."""
    real = socket.getaddrinfo
    asked: list[str] = []

    def fake(
        host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0, flags: int = 0
    ) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name != "localhost":
            try:
                return real(host, port, family, type, proto, flags | socket.AI_NUMERICHOST)
            except socket.gaierror:
                asked.append(name)
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known") from None
        return real(host, port, family, type, proto, flags)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    return asked


@pytest.fixture(autouse=True)
def _no_backstop() -> Iterator[None]:
    uninstall_backstop()
    yield
    uninstall_backstop()


def run(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        return await asyncio.wait_for(coro_fn(), 10)

    return asyncio.run(main(), loop_factory=new_event_loop)


class RebindingResolver:
    """Answers `first` on the first lookup and `later` afterwards (DNS rebinding)."""

    def __init__(self, first: list[str], later: list[str]) -> None:
        self.answers = [first, later]
        self.calls = 0

    async def resolve(self, host: str, port: int) -> list[str]:
        self.calls += 1
        return self.answers[min(self.calls - 1, 1)]


class ExplodingResolver:
    async def resolve(self, host: str, port: int) -> list[str]:
        raise AssertionError(f"resolver called for {host}")


async def fetch(host: str, port: int) -> bytes:
    """Open a real asyncio connection (through the running loop) and read the reply."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    data = await reader.read()
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return data


# ----------------------------------------------------------------------------- resolvers


def test_static_resolver_normalises_and_falls_back() -> None:
    inner = StaticResolver({"b.example": ["8.8.4.4"]})
    r = StaticResolver({"A.Example.": ["8.8.8.8", "1.1.1.1"]}, fallback=inner)

    async def go() -> tuple[list[str], list[str]]:
        return await r.resolve("a.example", 443), await r.resolve("B.EXAMPLE", 443)

    assert run(go) == (["8.8.8.8", "1.1.1.1"], ["8.8.4.4"])
    with pytest.raises(socket.gaierror):
        run(lambda: r.resolve("c.example", 443))


def test_system_resolver_uses_socket_getaddrinfo() -> None:
    assert run(lambda: SystemResolver().resolve("localhost", 80)) == ["127.0.0.1"]


def test_parse_overrides() -> None:
    assert parse_overrides({"api.internal": "10.0.0.5:8443", "x:443": "[::1]:1"}) == {
        "api.internal": ("10.0.0.5", 8443),
        "x:443": ("::1", 1),
    }
    with pytest.raises(ValueError, match="needs a port"):
        parse_overrides({"a": "10.0.0.5"})


# ----------------------------------------------------------------------------- the guard

FORBIDDEN = [
    "127.0.0.1", "10.0.0.1", "172.16.0.1", "192.168.0.1", "100.64.0.1", "169.254.169.254",
    "0.0.0.0", "224.0.0.1", "255.255.255.255", "192.0.2.1", "198.18.0.1", "240.0.0.1",
    "::1", "::", "fe80::1", "fc00::1", "fd00:ec2::254", "ff02::1", "::ffff:127.0.0.1",
    "::ffff:169.254.169.254", "64:ff9b::808:808", "64:ff9b:1::1", "2002:808:808::1",
    "2001:0:4136:e378:8000:63bf:3fff:fdd2", "::7f00:1",
]


@pytest.mark.parametrize("ip", FORBIDDEN)
def test_name_resolving_to_forbidden_range_is_refused(ip: str) -> None:
    guard = DestinationGuard(AddressPolicy(), StaticResolver({"evil.example": [ip]}))
    with pytest.raises(DestinationRefused) as info:
        run(lambda: guard.check("evil.example", 443))
    err = info.value
    assert err.code == "forbidden_destination"
    assert err.status == 403
    assert "evil.example resolves to" in err.reason and ip in err.reason
    assert err.verdict is not None and not err.verdict.allowed


def test_first_allowed_answer_is_pinned() -> None:
    resolver = StaticResolver({"multi.example": ["10.0.0.1", "8.8.8.8", "1.1.1.1"]})
    pinned = run(lambda: DestinationGuard(AddressPolicy(), resolver).check("Multi.Example.", 443))
    assert pinned == Pinned("multi.example", 443, "8.8.8.8", trusted=False)
    assert pinned.address == ("8.8.8.8", 443)


def test_all_answers_forbidden_names_first_and_counts() -> None:
    resolver = StaticResolver({"m.example": ["10.0.0.1", "127.0.0.1"]})
    with pytest.raises(DestinationRefused) as info:
        run(lambda: DestinationGuard(AddressPolicy(), resolver).check("m.example", 443))
    assert "10.0.0.1" in info.value.reason and "1 other" in info.value.reason
    assert "network.allow_cidrs" in info.value.reason


def test_unresolvable_and_timeout() -> None:
    guard = DestinationGuard(AddressPolicy(), StaticResolver({}))
    with pytest.raises(DestinationRefused) as info:
        run(lambda: guard.check("nowhere.example", 443))
    assert info.value.code == "unresolvable" and info.value.status == 502
    assert info.value.reason.startswith("could not resolve nowhere.example: ")

    class Slow:
        async def resolve(self, host: str, port: int) -> list[str]:
            await asyncio.sleep(5)
            return ["8.8.8.8"]

    slow = DestinationGuard(AddressPolicy(), Slow(), timeout=0.05)
    with pytest.raises(DestinationRefused, match=r"no answer within 0\.05s") as info:
        run(lambda: slow.check("slow.example", 443))
    assert info.value.code == "unresolvable"

    empty = DestinationGuard(AddressPolicy(), StaticResolver({"e.example": []}))
    with pytest.raises(DestinationRefused, match="no addresses"):
        run(lambda: empty.check("e.example", 443))


@pytest.mark.parametrize(
    "host", ["0x7f.1", "2130706433", "[::ffff:127.0.0.1]", "0251.0376.0251.0376"]
)
def test_ip_literals_skip_dns_but_are_classified(host: str) -> None:
    guard = DestinationGuard(AddressPolicy(), ExplodingResolver())
    with pytest.raises(DestinationRefused) as info:
        run(lambda: guard.check(host, 80))
    assert info.value.code == "forbidden_destination"
    assert run(lambda: guard.check("0x08080808", 80)) == Pinned("8.8.8.8", 80, "8.8.8.8")


@pytest.mark.parametrize("host", ["a b.example", "evil.example/x", "", "a..b", "x@y"])
def test_invalid_host_is_bad_destination(host: str) -> None:
    guard = DestinationGuard(AddressPolicy(), ExplodingResolver())
    with pytest.raises(DestinationRefused) as info:
        run(lambda: guard.check(host, 443))
    assert info.value.code == "bad_destination"


def test_trusted_override_skips_ranges_but_not_self_or_metadata() -> None:
    policy = AddressPolicy(own_addresses=[("127.0.0.1", 8090)])
    guard = DestinationGuard(
        policy,
        ExplodingResolver(),
        {
            "api.internal": ("10.0.0.5", 8443),
            "api.internal:80": ("10.0.0.6", 8080),
            "admin.example": ("127.0.0.1", 8090),
            "meta.example": ("169.254.169.254", 80),
        },
    )
    assert run(lambda: guard.check("API.internal.", 443)) == Pinned(
        "api.internal", 443, "10.0.0.5", trusted=True, dial_port=8443
    )
    assert run(lambda: guard.check("api.internal", 80)).address == ("10.0.0.6", 8080)
    for host, code in (("admin.example", "deny_self_connection"),
                       ("meta.example", "deny_not_global_unicast")):
        with pytest.raises(DestinationRefused) as info:
            run(lambda h=host: guard.check(h, 443))  # type: ignore[misc]
        assert info.value.verdict is not None and info.value.verdict.code == code
        assert "network.resolve" in info.value.reason


def test_rebinding_second_answer_is_refused() -> None:
    resolver = RebindingResolver(["8.8.8.8"], ["127.0.0.1"])
    guard = DestinationGuard(AddressPolicy(), resolver)
    assert run(lambda: guard.check("rebind.example", 443)).ip == "8.8.8.8"
    with pytest.raises(DestinationRefused):
        run(lambda: guard.check("rebind.example", 443))


# ----------------------------------------------------------------------------- pinning


def test_pinned_connect_beats_system_resolution(
    canaries: dict[str, Canary], no_dns: list[str]
) -> None:
    """System resolution of `localhost` gives canary 127.0.0.1, the pin says 127.0.0.3
    (a trusted override, as network.resolve does): the pinned canary gets the connection."""
    port = canaries["127.0.0.1"].port
    policy = AddressPolicy()
    guard = DestinationGuard(policy, ExplodingResolver(), {"localhost": ("127.0.0.3", port)})
    install_backstop(policy)

    async def go() -> bytes:
        pin(await guard.check("localhost", port))
        return await fetch("localhost", port)

    assert run(go).endswith(b"canary 127.0.0.3")
    assert len(canaries["127.0.0.3"].hits) == 1
    assert canaries["127.0.0.1"].hits == [] and canaries["127.0.0.2"].hits == []


def test_dns_rebinding_never_reaches_loopback(canaries: dict[str, Canary]) -> None:
    """The guard sees 127.0.0.3 (allowed: stands in for a public address); every later
    answer (the loop's own lookup of `localhost`) is 127.0.0.1. The connect uses the pin."""
    port = canaries["127.0.0.1"].port
    policy = AddressPolicy(allow_cidrs=["127.0.0.3/32"])
    resolver = RebindingResolver(["127.0.0.3"], ["127.0.0.1"])
    guard = DestinationGuard(policy, resolver)
    install_backstop(policy)

    async def go() -> bytes:
        pinned = await guard.check("localhost", port)
        assert not pinned.trusted
        pin(pinned)
        first = await fetch("localhost", port)
        second = await fetch("localhost", port)  # the pin holds for the whole task
        return first + second

    assert run(go).count(b"canary 127.0.0.3") == 2
    assert len(canaries["127.0.0.3"].hits) == 2
    assert canaries["127.0.0.1"].hits == []
    with pytest.raises(DestinationRefused):  # a fresh check sees the rebound answer
        run(lambda: guard.check("localhost", port))


def test_backstop_without_pin_drops_forbidden_answers(canaries: dict[str, Canary]) -> None:
    port = canaries["127.0.0.1"].port
    install_backstop(AddressPolicy())
    assert installed_backstop() is not None
    with pytest.raises(BackstopRefused, match="refused every address of 'localhost'"):
        run(lambda: fetch("localhost", port))
    # IP literals never reach getaddrinfo: sock_connect refuses them.
    with pytest.raises(BackstopRefused, match=r"refused to connect to 127\.0\.0\.2"):
        run(lambda: fetch("127.0.0.2", port))
    assert all(c.hits == [] for c in canaries.values())


def test_unguarded_exempts_trusted_code_but_not_upstream_tasks(
    canaries: dict[str, Canary],
) -> None:
    port = canaries["127.0.0.1"].port
    install_backstop(AddressPolicy())

    async def trusted_code() -> bytes:
        with unguarded():
            return await fetch("localhost", port)

    assert run(trusted_code).endswith(b"canary 127.0.0.1")

    async def upstream_task() -> bytes:
        with unguarded():  # inherited exemption...
            mark_upstream()  # ...is ignored in an upstream-dialling task
            return await fetch("127.0.0.2", port)

    with pytest.raises(BackstopRefused):
        run(upstream_task)
    assert canaries["127.0.0.2"].hits == []


def test_marked_only_scope(canaries: dict[str, Canary]) -> None:
    port = canaries["127.0.0.1"].port
    install_backstop(AddressPolicy(), everywhere=False)
    assert run(lambda: fetch("127.0.0.2", port)).endswith(b"canary 127.0.0.2")

    async def upstream() -> bytes:
        mark_upstream()
        return await fetch("127.0.0.2", port)

    with pytest.raises(BackstopRefused):
        run(upstream)
    assert len(canaries["127.0.0.2"].hits) == 1


def test_pin_is_bound_to_its_task_and_host() -> None:
    pinned = Pinned("a.example", 443, "8.8.8.8")

    async def go() -> tuple[Pinned | None, Pinned | None, Pinned | None, Any]:
        pin(pinned)
        mine = current_pin()
        child = await asyncio.create_task(asyncio.sleep(0, current_pin()))

        async def child_pin() -> Pinned | None:
            return current_pin()

        inherited = await asyncio.create_task(child_pin())
        loop = asyncio.get_running_loop()
        # Another host or port on the pinned task resolves normally (no backstop here).
        other = await loop.getaddrinfo("localhost", 443, type=socket.SOCK_STREAM)
        pinned_info = await loop.getaddrinfo("A.EXAMPLE.", "443", type=socket.SOCK_STREAM)
        unpin()
        assert current_pin() is None
        return mine, child, inherited, (other, pinned_info)

    mine, _, inherited, (other, pinned_info) = run(go)
    assert mine == pinned and inherited is None
    assert other[0][4] == ("127.0.0.1", 443)
    assert pinned_info == [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "",
                            ("8.8.8.8", 443))]


def test_pinned_ipv6_and_family_mismatch() -> None:
    async def go() -> list[tuple[Any, ...]]:
        pin(Pinned("v6.example", 443, "2001:4860:4860::8888"))
        loop = asyncio.get_running_loop()
        with pytest.raises(socket.gaierror):
            await loop.getaddrinfo("v6.example", 443, family=socket.AF_INET)
        return await loop.getaddrinfo("v6.example", 443)

    info = run(go)
    assert info[0][0] == socket.AF_INET6 and info[0][4] == ("2001:4860:4860::8888", 443, 0, 0)


def test_pin_outside_a_task_is_an_error() -> None:
    with pytest.raises(RuntimeError):
        pin(Pinned("a", 1, "8.8.8.8"))


def test_policy_and_factory_make_guarded_loops() -> None:
    loop = GuardedEventLoopPolicy().new_event_loop()
    try:
        assert isinstance(loop, GuardedEventLoop)
    finally:
        loop.close()
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        assert isinstance(runner.get_loop(), GuardedEventLoop)


def test_local_interface_addresses_include_loopback() -> None:
    addrs = local_interface_addresses()
    assert "127.0.0.1" in addrs or addrs == []


# ----------------------------------------------------------------------------- mitmproxy


class _MitmThread:
    """A minimal mitmproxy Master on a GuardedEventLoop in a thread, with a test addon
    whose async server_connect checks and pins (the mechanism the gateway addon uses)."""

    def __init__(self, guard: DestinationGuard, skip_check: set[str]) -> None:
        self.guard = guard
        self.skip_check = skip_check
        self.port = 0
        self.error: BaseException | None = None
        self.pins_seen: list[Pinned | None] = []
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._master: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _MitmThread:
        self._thread.start()
        if not self._ready.wait(10) or self.error or not self.port:
            raise RuntimeError(f"mitmproxy did not start: {self.error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._master is not None:
            master = self._master

            async def stop() -> None:
                # mitmproxy's shutdown leaves its listeners open: close them first.
                await master.addons.get("proxyserver").servers.update([])
                master.shutdown()

            asyncio.run_coroutine_threadsafe(stop(), self._loop)
        self._thread.join(10)

    def _run(self) -> None:
        try:
            asyncio.run(self._main(), loop_factory=new_event_loop)
        except BaseException as e:
            self.error = e
            self._ready.set()

    async def _main(self) -> None:
        from mitmproxy import options
        from mitmproxy.addons import core, errorcheck, next_layer, proxyserver, tlsconfig
        from mitmproxy.master import Master

        outer = self

        class PinAddon:
            async def server_connect(self, data: Any) -> None:
                host, port = data.server.address[:2]
                if host in outer.skip_check:  # a hook that "failed" to pin
                    return
                try:
                    pinned = await outer.guard.check(host, port)
                except DestinationRefused as e:
                    data.server.error = f"{REFUSED_MARK}{e.code}: {e.reason}"
                    return
                pin(pinned)

            def server_connected(self, data: Any) -> None:
                outer.pins_seen.append(current_pin())

        self._loop = asyncio.get_running_loop()
        assert isinstance(self._loop, GuardedEventLoop)
        master = Master(options.Options(), with_termlog=False)
        master.addons.add(  # type: ignore[no-untyped-call]
            core.Core(), proxyserver.Proxyserver(),  # type: ignore[no-untyped-call]
            next_layer.NextLayer(), tlsconfig.TlsConfig(), errorcheck.ErrorCheck(), PinAddon(),
        )
        master.options.update(listen_host="127.0.0.1", listen_port=0)  # type: ignore[no-untyped-call]
        self._master = master
        run_task = asyncio.create_task(master.run())
        ps = master.addons.get("proxyserver")  # type: ignore[no-untyped-call]
        for _ in range(200):
            addrs = ps.listen_addrs()
            if addrs:
                self.port = addrs[0][1]
                break
            await asyncio.sleep(0.01)
        self._ready.set()
        await run_task


def _proxy_get(proxy_port: int, url: str) -> bytes:
    host = url.split("/")[2]
    with socket.create_connection(("127.0.0.1", proxy_port), timeout=5) as s:
        s.sendall(f"GET {url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


# Third-party noise while mitmproxy starts (pyparsing via mitmproxy, pyasn1 via ldap3).
@pytest.mark.filterwarnings("ignore::DeprecationWarning:pyparsing.*")
@pytest.mark.filterwarnings("ignore::DeprecationWarning:ldap3.*")
def test_real_mitmproxy_pins_through_the_loop(
    canaries: dict[str, Canary], no_dns: list[str]
) -> None:
    port = canaries["127.0.0.1"].port
    policy = AddressPolicy(allow_cidrs=["127.0.0.3/32"])
    resolver = StaticResolver({"good.example": ["127.0.0.3"], "evil.example": ["127.0.0.1"]})
    guard = DestinationGuard(policy, resolver, {"trusted.example": ("127.0.0.2", port)})
    install_backstop(policy)
    started = time.monotonic()
    with _MitmThread(guard, skip_check={"localhost"}) as mitm:
        good = _proxy_get(mitm.port, f"http://good.example:{port}/")
        trusted = _proxy_get(mitm.port, f"http://trusted.example:{port}/")
        evil = _proxy_get(mitm.port, f"http://evil.example:{port}/")
        literal = _proxy_get(mitm.port, f"http://0x7f.1:{port}/")
        unpinned = _proxy_get(mitm.port, f"http://localhost:{port}/")  # hook did not pin
    assert time.monotonic() - started < 10
    assert good.startswith(b"HTTP/1.1 200") and good.endswith(b"canary 127.0.0.3")
    assert trusted.startswith(b"HTTP/1.1 200") and trusted.endswith(b"canary 127.0.0.2")
    assert b"forbidden_destination" in evil and b"evil.example resolves to 127.0.0.1" in evil
    assert b"forbidden_destination" in literal
    assert not unpinned.startswith(b"HTTP/1.1 200") and b"sandbox-gateway refused" in unpinned
    assert canaries["127.0.0.1"].hits == []
    assert len(canaries["127.0.0.3"].hits) == 1 and len(canaries["127.0.0.2"].hits) == 1
    # The pin set in the async server_connect hook is visible in the same task later on.
    assert [p.host for p in mitm.pins_seen if p] == ["good.example", "trusted.example"]
    assert no_dns == []  # pinned names never went to the system resolver
