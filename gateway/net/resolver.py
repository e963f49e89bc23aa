"""Checked, pinned resolution: the gateway connects to exactly the address it checked.

mitmproxy has no resolver hook. `proxy/server.py` `open_connection` runs in its own
task per upstream connection: it awaits the `server_connect` addon hooks (directly, in
that same task, so a `ContextVar` set by an async hook is visible afterwards) and then
calls `asyncio.open_connection(host, port)`, which calls `loop.getaddrinfo` (names
only: inet_pton-valid literals skip it) and then `loop.sock_connect` per address.

So:

1. the gateway's `server_connect` hook calls `DestinationGuard.check(host, port)`
   (resolve, classify every address, take the first allowed one) and `pin(pinned)`,
   or sets `data.server.error` on `DestinationRefused`;
2. `GuardedEventLoop.getaddrinfo` answers the pinned (host, port) of the current task
   with the pinned address only, so a second DNS answer (rebinding) is never used;
3. as a backstop, `GuardedEventLoop` drops forbidden addresses from every other
   `getaddrinfo` answer and refuses `sock_connect` to a forbidden address (this also
   covers IP literals, which never reach `getaddrinfo`), so a hook that failed to pin
   still cannot reach a forbidden address.

Verified on mitmproxy 12.2.3 (eager task factory on) by
tests/test_resolver.py::test_real_mitmproxy_pins_through_the_loop: a pin set in an
async `server_connect` hook is what the loop's `getaddrinfo` answers for that dial and
is still visible in the `server_connected` hook; the system resolver is never asked.

Backstop scope (`install_backstop(policy, everywhere=...)`):
- `everywhere=True` (default, fail closed): every connection made through the loop is
  checked, except inside `with unguarded():`, which trusted gateway code (Key Vault
  client, Redis, test fakes on 127.0.0.1) wraps around its own calls to
  operator-configured endpoints. `pin()` marks its task as upstream dialling, where an
  inherited `unguarded()` is ignored: a sandbox-chosen destination is always checked.
- `everywhere=False`: only tasks marked by `pin()` / `mark_upstream()` are checked;
  other components need no exemption, but a hook failure before marking leaves that
  connection to the `server_connect` check alone.

Pins and marks are bound to the task that set them (a child task inherits the
ContextVar but not its effect), so a `response` hook task spawned from an upstream
connection task is not itself "upstream dialling".

Limits: only asyncio TCP through this loop is covered (uvloop bypasses
`loop.getaddrinfo`; mitmproxy's UDP/QUIC goes through mitmproxy_rs; blocking
`socket` calls in threads are not seen). `happy_eyeballs_delay` runs connects in child
tasks, where a trusted pin does not apply (fails closed); mitmproxy does not use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import ipaddress
import socket
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gateway.core.addresses import AddressPolicy, Pinned, Verdict, parse_address_rule, parse_ip
from gateway.core.names import DestinationError, normalize_host, parse_host_ip
from gateway.core.refusal import Refusal

__all__ = [
    "BackstopRefused",
    "DestinationGuard",
    "DestinationRefused",
    "GuardedEventLoop",
    "GuardedEventLoopPolicy",
    "Pinned",
    "Resolver",
    "StaticResolver",
    "SystemResolver",
    "current_pin",
    "install_backstop",
    "installed_backstop",
    "local_interface_addresses",
    "mark_upstream",
    "new_event_loop",
    "parse_overrides",
    "pin",
    "proxy_hop",
    "route_pinned_dial",
    "unguarded",
    "uninstall_backstop",
    "unpin",
]

FORBIDDEN = "forbidden_destination"
UNRESOLVABLE = "unresolvable"
BAD_DESTINATION = "bad_destination"


# --------------------------------------------------------------------------------------
# Resolvers
# --------------------------------------------------------------------------------------


class Resolver(Protocol):
    """Resolves a host name to IP address strings, in preference order.

    Raises OSError (e.g. socket.gaierror) when the name cannot be resolved.
    """

    async def resolve(self, host: str, port: int) -> list[str]: ...


def _unique_ips(infos: Sequence[tuple[Any, ...]]) -> list[str]:
    seen: dict[str, None] = {}
    for info in infos:
        family, sockaddr = info[0], info[4]
        if family in (socket.AF_INET, socket.AF_INET6):
            seen.setdefault(str(sockaddr[0]), None)
    return list(seen)


class SystemResolver:
    """The system resolver (glibc getaddrinfo in a worker thread).

    Calls `socket.getaddrinfo` directly, not `loop.getaddrinfo`, so the guard's own
    lookups never go through (or recurse into) `GuardedEventLoop`.
    """

    async def resolve(self, host: str, port: int) -> list[str]:
        loop = asyncio.get_running_loop()
        call = functools.partial(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
        return _unique_ips(await loop.run_in_executor(None, call))


class StaticResolver:
    """Fixed answers (`host -> [ip, ...]`), else `fallback`, else "not known".

    For tests (names mapped to loopback canaries) and fixed name tables.
    """

    def __init__(
        self, mapping: Mapping[str, Sequence[str]], fallback: Resolver | None = None
    ) -> None:
        self._mapping = {normalize_host(h): list(ips) for h, ips in mapping.items()}
        self._fallback = fallback

    async def resolve(self, host: str, port: int) -> list[str]:
        ips = self._mapping.get(normalize_host(host))
        if ips is not None:
            return list(ips)
        if self._fallback is not None:
            return await self._fallback.resolve(host, port)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


# --------------------------------------------------------------------------------------
# The guard
# --------------------------------------------------------------------------------------


class DestinationRefused(Refusal):
    """A refused destination. `code` is `forbidden_destination` (403; `verdict` says
    which address and rule), `unresolvable` (502) or `bad_destination` (invalid host)."""

    def __init__(self, code: str, reason: str, rule: str | None = None,
                 verdict: Verdict | None = None) -> None:
        super().__init__(code, reason, rule)
        self.verdict = verdict


def parse_overrides(mapping: Mapping[str, str]) -> dict[str, tuple[str, int]]:
    """Parse `network.resolve` (`host` or `host:port` -> `ip:port`) for DestinationGuard."""
    out: dict[str, tuple[str, int]] = {}
    for key, target in mapping.items():
        ip, port = parse_address_rule(target)
        if port is None:
            raise DestinationError(f"network.resolve[{key!r}]: target {target!r} needs a port")
        out[key] = (ip.compressed, port)
    return out


def _override_key(key: str) -> str:
    """Normalise an override key: `host` or `host:port` (`[v6]:port`)."""
    if key.count(":") == 1 or (key.startswith("[") and "]:" in key):
        host, _, port = key.rpartition(":")
        return f"{normalize_host(host)}:{int(port)}"
    return normalize_host(key)


class DestinationGuard:
    """Resolve, classify and choose the address to dial for one upstream connection.

    `overrides` (network.resolve, see `parse_overrides`) map `host` or `host:port` to an
    operator-trusted `(ip, port)`: no DNS, range rules skipped, but the gateway's own
    listeners and hard ranges (cloud metadata, ...) are still refused.
    """

    def __init__(
        self,
        address_policy: AddressPolicy,
        resolver: Resolver | None = None,
        overrides: Mapping[str, tuple[str, int]] | None = None,
        *,
        timeout: float = 5.0,
    ) -> None:
        self.policy = address_policy
        self.resolver: Resolver = resolver if resolver is not None else SystemResolver()
        self.timeout = timeout
        self._overrides: dict[str, tuple[str, int]] = {}
        for key, (ip, port) in (overrides or {}).items():
            self._overrides[_override_key(key)] = (parse_ip(ip).compressed, port)

    async def check(self, host: str, port: int) -> Pinned:
        """The address to dial for host:port, or DestinationRefused."""
        name = self._name(host)
        fixed = self._fixed(name, port)
        if fixed is not None:
            return fixed
        return self._choose(name, port, await self._resolve(name, port))

    async def check_all(self, host: str, port: int) -> list[Pinned]:
        """Every allowed address of host:port, in the resolver's order (the first is the
        one `check` dials), or DestinationRefused when none is allowed. For the DNS
        resolver, which hands a sandbox all the addresses the gateway would accept."""
        name = self._name(host)
        fixed = self._fixed(name, port)
        if fixed is not None:
            return [fixed]
        ips = await self._resolve(name, port)
        allowed: dict[str, Pinned] = {}
        for text in ips:
            try:
                verdict = self.policy.classify(text, port)
            except DestinationError:
                continue
            if verdict.allowed:
                ip = ipaddress.ip_address(text.split("%", 1)[0]).compressed
                allowed.setdefault(ip, Pinned(name, port, ip))
        # None allowed: `_choose` raises the refusal `check` would raise.
        return list(allowed.values()) or [self._choose(name, port, ips)]

    @staticmethod
    def _name(host: str) -> str:
        try:
            return normalize_host(host)
        except DestinationError as e:
            raise DestinationRefused(
                BAD_DESTINATION, f"{host!r} is not a valid destination host: {e}"
            ) from None

    def _fixed(self, name: str, port: int) -> Pinned | None:
        """The pin for an override (network.resolve) or an IP literal; None for a name."""
        override = self._overrides.get(f"{name}:{port}") or self._overrides.get(name)
        if override is not None:
            ip, dial_port = override
            verdict = self.policy.classify_trusted(ip, dial_port)
            if not verdict.allowed:
                raise DestinationRefused(
                    FORBIDDEN, f"{name} is mapped by network.resolve to {ip}: {verdict.reason}",
                    verdict=verdict,
                )
            return Pinned(name, port, ip, trusted=True, dial_port=dial_port)
        if parse_host_ip(name) is not None:
            verdict = self.policy.classify(name, port)
            if not verdict.allowed:
                raise DestinationRefused(FORBIDDEN, verdict.reason, verdict=verdict)
            return Pinned(name, port, name)
        return None

    async def _resolve(self, name: str, port: int) -> list[str]:
        try:
            async with asyncio.timeout(self.timeout):
                ips = await self.resolver.resolve(name, port)
        except TimeoutError:
            raise DestinationRefused(
                UNRESOLVABLE, f"could not resolve {name}: no answer within {self.timeout:g}s"
            ) from None
        except (OSError, UnicodeError, DestinationError) as e:
            detail = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise DestinationRefused(
                UNRESOLVABLE, f"could not resolve {name}: {detail}"
            ) from None
        if not ips:
            raise DestinationRefused(UNRESOLVABLE, f"could not resolve {name}: no addresses")
        return ips

    def _choose(self, name: str, port: int, ips: list[str]) -> Pinned:
        first: tuple[str, Verdict] | None = None
        for text in ips:
            try:
                verdict = self.policy.classify(text, port)
            except DestinationError:
                continue
            if verdict.allowed:
                ip = ipaddress.ip_address(text.split("%", 1)[0]).compressed
                return Pinned(name, port, ip)
            if first is None:
                first = (text, verdict)
        if first is None:
            raise DestinationRefused(
                UNRESOLVABLE, f"could not resolve {name}: no valid addresses in the answer"
            )
        text, verdict = first
        more = f" ({len(ips) - 1} other address(es) refused too)" if len(ips) > 1 else ""
        raise DestinationRefused(
            FORBIDDEN, f"{name} resolves to {text}{more}: {verdict.reason}", verdict=verdict
        )


# --------------------------------------------------------------------------------------
# Pinning and the backstop
# --------------------------------------------------------------------------------------

# The task a value was set in, by weak reference: a context belongs to its task, so a
# strong one is a cycle (task -> context -> value -> task) that keeps every finished
# connection task, and what it reaches, until a full garbage collection.
TaskRef = weakref.ReferenceType[asyncio.Task[Any]]
_PIN: ContextVar[tuple[TaskRef, Pinned] | None] = ContextVar(
    "sandbox_gateway_pin", default=None
)
_UPSTREAM: ContextVar[TaskRef | None] = ContextVar(
    "sandbox_gateway_upstream_task", default=None
)
_EXEMPT: ContextVar[bool] = ContextVar("sandbox_gateway_unguarded", default=False)
_HOP: ContextVar[tuple[str, int] | None] = ContextVar("sandbox_gateway_proxy_hop",
                                                      default=None)
Dialer = Callable[[Any, Callable[[], Any]], Awaitable[tuple[asyncio.Transport, Any]]]
_ROUTE: ContextVar[tuple[TaskRef, Dialer] | None] = ContextVar(
    "sandbox_gateway_pinned_route", default=None)


@dataclass(slots=True)
class _Backstop:
    policy: AddressPolicy | None = None
    everywhere: bool = True


_BACKSTOP = _Backstop()


def install_backstop(policy: AddressPolicy, *, everywhere: bool = True) -> None:
    """Make every GuardedEventLoop refuse forbidden addresses (see module docstring)."""
    _BACKSTOP.policy = policy
    _BACKSTOP.everywhere = everywhere


def uninstall_backstop() -> None:
    """Remove the backstop (tests; a gateway never does this)."""
    _BACKSTOP.policy = None
    _BACKSTOP.everywhere = True


def installed_backstop() -> AddressPolicy | None:
    """The installed backstop policy, if any."""
    return _BACKSTOP.policy


def _task() -> TaskRef:
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("pinning needs a running asyncio task")
    return weakref.ref(task)


def _is_current(ref: TaskRef | None) -> bool:
    """`ref` is the running task's (set in this task, not inherited from its parent)."""
    task = asyncio.current_task()
    return task is not None and ref is not None and ref() is task


def mark_upstream() -> None:
    """Mark the current task as dialling a sandbox-chosen destination: the backstop
    applies to it whatever the scope, and `unguarded()` is ignored in it."""
    _UPSTREAM.set(_task())


def pin(pinned: Pinned) -> None:
    """Pin host:port -> ip for the current task (call from the `server_connect` hook)."""
    task = _task()
    _PIN.set((task, pinned))
    _UPSTREAM.set(task)


def unpin() -> None:
    """Forget the current task's pin (the upstream mark stays)."""
    _PIN.set(None)


@contextlib.contextmanager
def proxy_hop(ip: str, port: int) -> Iterator[None]:
    """The upstream proxy's own address (operator configuration): the backstop lets
    exactly `ip`:`port` be dialled from an upstream-marked task while this holds, and
    the pinned-dial route is not taken for it (`gateway/net/upstream_proxy.py`)."""
    token = _HOP.set((parse_ip(ip).compressed, port))
    try:
        yield
    finally:
        _HOP.reset(token)


def route_pinned_dial(dial: Dialer) -> None:
    """Make this task's dial of its pinned destination (`loop.create_connection` to the
    pinned name or address) go through `dial(loop, protocol_factory)` instead: how
    mitmproxy's dials, which have no hook of their own, go through the upstream proxy
    or are bounded by `network.timeouts.connect`. One dial: the route is spent by it (a
    `loop.create_connection` inside `dial` is not routed again)."""
    _ROUTE.set((_task(), dial))


def current_pin() -> Pinned | None:
    """The pin set by the current task, if any (inherited pins do not count)."""
    value = _PIN.get()
    if value is None or not _is_current(value[0]):
        return None
    return value[1]


@contextlib.contextmanager
def unguarded() -> Iterator[None]:
    """Exempt trusted gateway code (vault, Redis, fakes) from an `everywhere` backstop.

    Never wrap code that connects to a sandbox-chosen destination in this."""
    token = _EXEMPT.set(True)
    try:
        yield
    finally:
        _EXEMPT.reset(token)


def _active_policy() -> AddressPolicy | None:
    policy = _BACKSTOP.policy
    if policy is None:
        return None
    if _is_current(_UPSTREAM.get()):
        return policy
    if _BACKSTOP.everywhere and not _EXEMPT.get():
        return policy
    return None


class BackstopRefused(PermissionError):
    """Raised by GuardedEventLoop instead of connecting to a forbidden address."""


def _matches(pinned: Pinned, host: object, port: object) -> bool:
    try:
        text = host.decode("idna") if isinstance(host, bytes) else str(host)
        port_no = int(port.decode() if isinstance(port, bytes) else port)  # type: ignore[call-overload]
        return port_no == pinned.port and normalize_host(text) == pinned.host
    except (DestinationError, ValueError, TypeError, UnicodeError):
        return False


def _dials_address(pinned: Pinned, host: object, port: object) -> bool:
    try:
        return (str(host), int(port)) == pinned.address  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return False


def _pinned_infos(
    pinned: Pinned, family: int, type_: int, proto: int
) -> list[tuple[Any, ...]]:
    ip, port = pinned.address
    fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
    if family not in (socket.AF_UNSPEC, fam):
        raise socket.gaierror(socket.EAI_FAMILY, "pinned address has another family")
    sockaddr: tuple[Any, ...] = (ip, port, 0, 0) if fam == socket.AF_INET6 else (ip, port)
    type_ = type_ or socket.SOCK_STREAM
    proto = proto or (socket.IPPROTO_TCP if type_ == socket.SOCK_STREAM else 0)
    return [(fam, type_, proto, "", sockaddr)]


class GuardedEventLoop(asyncio.SelectorEventLoop):
    """An event loop that dials pinned addresses and never a forbidden one."""

    async def getaddrinfo(
        self,
        host: bytes | str | None,
        port: bytes | str | int | None,
        *,
        family: int = 0,
        type: int = 0,
        proto: int = 0,
        flags: int = 0,
    ) -> list[tuple[Any, ...]]:
        pinned = current_pin()
        if pinned is not None and host is not None and _matches(pinned, host, port):
            return _pinned_infos(pinned, family, type, proto)
        infos: list[tuple[Any, ...]] = list(
            await super().getaddrinfo(
                host, port, family=family, type=type, proto=proto, flags=flags
            )
        )
        policy = _active_policy()
        if policy is None:
            return infos
        kept: list[tuple[Any, ...]] = []
        refused: Verdict | None = None
        for info in infos:
            if info[0] not in (socket.AF_INET, socket.AF_INET6):
                kept.append(info)
                continue
            verdict = policy.classify(str(info[4][0]), int(info[4][1]))
            if verdict.allowed:
                kept.append(info)
            elif refused is None:
                refused = verdict
        if not kept and refused is not None:
            raise BackstopRefused(
                errno.EACCES, f"sandbox-gateway refused every address of {host!r}: {refused.reason}"
            )
        return kept

    async def create_connection(
        self, protocol_factory: Callable[[], Any], host: Any = None, port: Any = None,
        **kwargs: Any,
    ) -> tuple[asyncio.Transport, Any]:
        route = _ROUTE.get()
        if route is not None and _is_current(route[0]) and _HOP.get() is None \
                and host is not None and kwargs.get("sock") is None:
            pinned = current_pin()
            if pinned is not None and (_matches(pinned, host, port)
                                       or _dials_address(pinned, host, port)):
                _ROUTE.set(None)  # once: the route's own dial goes direct
                return await route[1](self, protocol_factory)
        return await super().create_connection(
            protocol_factory, host, port, **kwargs)

    async def sock_connect(self, sock: socket.socket, address: Any) -> None:
        policy = _active_policy()
        if policy is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            ip, port = str(address[0]), int(address[1])
            pinned = current_pin()
            trusted = (
                pinned is not None
                and pinned.trusted
                and port == pinned.address[1]
                and parse_ip(ip) == parse_ip(pinned.ip)
            )
            hop = _HOP.get()
            if hop is not None and port == hop[1] and parse_ip(ip).compressed == hop[0]:
                trusted = True  # the upstream proxy itself (proxy_hop)
            if not trusted:
                verdict = policy.classify(ip, port)
                if not verdict.allowed:
                    raise BackstopRefused(
                        errno.EACCES,
                        f"sandbox-gateway refused to connect to {ip} port {port}: "
                        f"{verdict.reason}",
                    )
        return await super().sock_connect(sock, address)


def new_event_loop() -> GuardedEventLoop:
    """Loop factory: `asyncio.run(main(), loop_factory=new_event_loop)` or `asyncio.Runner`."""
    return GuardedEventLoop()


class GuardedEventLoopPolicy(asyncio.DefaultEventLoopPolicy):
    """An event-loop policy creating GuardedEventLoop (for code that uses policies)."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return GuardedEventLoop()


# --------------------------------------------------------------------------------------
# Local addresses (for wildcard listeners)
# --------------------------------------------------------------------------------------


def local_interface_addresses(proc: Path = Path("/proc/net")) -> list[str]:
    """Every address assigned to this host (Linux /proc; empty elsewhere).

    Used with wildcard listeners (0.0.0.0 / ::): a connection to any of these on the
    listening port reaches the gateway itself.
    """
    found: dict[str, None] = {}
    with contextlib.suppress(OSError):
        previous = ""
        for line in (proc / "fib_trie").read_text().splitlines():
            if "/32 host LOCAL" in line and previous:
                found.setdefault(previous, None)
            stripped = line.strip()
            if stripped.startswith(("|--", "+--")):
                previous = stripped[3:].strip().split("/")[0]
    with contextlib.suppress(OSError, ValueError):
        for line in (proc / "if_inet6").read_text().splitlines():
            raw = line.split()[0]
            found.setdefault(ipaddress.IPv6Address(int(raw, 16)).compressed, None)
    return list(found)
