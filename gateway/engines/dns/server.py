"""The DNS resolver's I/O: UDP and TCP listeners on `listen.dns`, one audit line and one
metric count per query.

Each query: who sent it (`Registry.sandbox_for(source ip)`: the core's identifier, a
transparent-mode registration or, with identity.kubernetes, the pod holding the
address) -> that sandbox's rate limit -> parse -> `answer()` (pure,
gateway/engines/dns/answer.py)
-> only if the policy allowed the name: `DestinationGuard.check_all` (the gateway's own
resolver, `network.resolve` overrides and destination checks) -> `answer()` again with
what it found. Nothing is ever forwarded to another DNS server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import dns.message
import dns.rcode

from gateway.config import DnsConfig, HostPort
from gateway.core.audit import record as audit_record
from gateway.core.evaluate import Grants
from gateway.core.names import DestinationError, normalize_host
from gateway.core.policy import Policy
from gateway.core.ports import Approvals, Registry
from gateway.engines.dns.answer import Lookup, Need, Outcome, answer, failure, formerr, parse
from gateway.engines.dns.limit import RateLimiter
from gateway.net.resolver import DestinationGuard, DestinationRefused
from gateway.observability import metrics
from gateway.observability.audit import Auditor
from gateway.services.state.base import SandboxAddress

__all__ = ["DnsServer"]

log = logging.getLogger("sandbox_gateway.dns")

UDP_MAX = 512  # no EDNS is parsed: classic UDP size; larger answers set TC (retry on TCP)
TCP_MAX = 65535
TCP_IDLE = 10.0  # seconds a TCP client may stay silent between queries
TCP_CONNECTIONS = 256  # open TCP connections at most (UDP is what stub resolvers use)
BACKLOG = 128
UNKNOWN = "\x00unknown"  # the rate-limit key all unregistered sources share
MAX_SHOWN = 300


class DnsServer:
    """Answers known sandboxes' A/AAAA queries for names their policy allows."""

    def __init__(self, config: DnsConfig, registry: Registry,
                 policies: Callable[[str], Policy | None], guard: DestinationGuard,
                 auditor: Auditor, approvals: Approvals | None = None) -> None:
        self.config = config
        self.approvals = approvals  # ask mode: the grants, as the proxy decides with them
        self.registry = registry
        self.policies = policies
        self.guard = guard
        self.auditor = auditor
        self.limiter = RateLimiter(config.rate, config.burst)
        self.addresses: list[tuple[str, int]] = []
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    def _grants(self, sandbox: SandboxAddress | None) -> Grants | None:
        """The sandbox's grants, as the proxy's decision reads them (ask mode)."""
        approvals = self.approvals
        if approvals is None or sandbox is None:
            return None
        return lambda request: approvals.grant_for(sandbox.sandbox, sandbox.policy, request)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self, listen: HostPort, *, shared: bool = False) -> None:
        """Bind UDP and TCP on the same port (port 0: a free one). `shared`: SO_REUSEPORT,
        for worker processes. Raises OSError when the port cannot be bound."""
        loop = asyncio.get_running_loop()
        reuse = True if shared else None
        for _ in range(8):
            tcp = await asyncio.start_server(self._serve_tcp, listen.host, listen.port,
                                             reuse_port=reuse, backlog=BACKLOG)
            port = int(tcp.sockets[0].getsockname()[1])
            try:
                udp, _ = await loop.create_datagram_endpoint(
                    lambda: _UdpProtocol(self), local_addr=(listen.host, port),
                    reuse_port=reuse)
            except OSError:
                tcp.close()
                await tcp.wait_closed()
                if listen.port != 0:
                    raise
                continue  # port 0: that port is taken for UDP, try another
            self._tcp, self._udp = tcp, udp
            self.addresses = [(listen.host, port)]
            return
        raise OSError(f"no port free for both UDP and TCP on {listen.host}")

    async def close(self) -> None:
        """Stop listening, end open TCP connections and pending lookups."""
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._tcp is not None:
            await self._tcp.wait_closed()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` as a task the server keeps (and cancels on close)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- one query -----------------------------------------------------------------------

    async def handle(self, wire: bytes, client: tuple[str, int], transport: str
                     ) -> bytes | None:
        """The reply to one query from `client` (None: send nothing)."""
        started = time.perf_counter()
        sandbox = self._sandbox(client[0])
        key = sandbox.sandbox if sandbox is not None else UNKNOWN
        query = parse(wire)
        if not self.limiter.allow(key):
            return self._rate_limited(query, sandbox, key, client, transport, started)
        if query is None:
            outcome = Outcome(None, "deny", "FORMERR", "not a DNS query", error="malformed")
            self._record(outcome, sandbox, client, transport, started)
            return formerr(wire)
        policy = self.policies(sandbox.policy) if sandbox is not None else None
        grants = self._grants(sandbox)
        try:
            outcome = answer(query, sandbox, policy, None, self.config.ttl, grants)
            if outcome.need is not None:
                lookup = await self._lookup(outcome.need)
                outcome = answer(query, sandbox, policy, lookup, self.config.ttl, grants)
        except Exception:  # fail closed: never an address after an error
            log.exception("DNS query from %s failed", client[0])
            outcome = failure(query, dns.rcode.SERVFAIL,
                              "the gateway failed to answer (see its log)", "gateway_error")
        self._record(outcome, sandbox, client, transport, started)
        return self._wire(outcome, transport)

    def _sandbox(self, ip: str) -> SandboxAddress | None:
        try:
            return self.registry.sandbox_for(normalize_host(ip))
        except DestinationError:
            return None

    async def _lookup(self, need: Need) -> Lookup:
        try:
            pinned = await self.guard.check_all(need.host, need.port)
        except DestinationRefused as refusal:
            return Lookup(error=refusal.code, reason=refusal.reason)
        return Lookup(tuple(p.ip for p in pinned))

    def _rate_limited(self, query: dns.message.Message | None, sandbox: SandboxAddress | None,
                      key: str, client: tuple[str, int], transport: str, started: float
                      ) -> bytes | None:
        reason = (f"rate limit: more than {self.config.rate:g} queries/s (burst "
                  f"{self.config.burst}) from this sandbox; dns.rate and dns.burst set it")
        if query is not None:
            outcome = failure(query, dns.rcode.REFUSED, reason, "rate_limited")
        else:
            outcome = Outcome(None, "deny", "REFUSED", reason, error="rate_limited")
        count = self.limiter.line_due(key)
        if count is None:
            self._count(sandbox, outcome)
        else:
            self._record(outcome, sandbox, client, transport, started, queries=count)
        return self._wire(outcome, transport) if query is not None else None

    def _wire(self, outcome: Outcome, transport: str) -> bytes | None:
        if outcome.response is None:
            return None
        size = UDP_MAX if transport == "udp" else TCP_MAX
        return outcome.response.to_wire(max_size=size, prefer_truncation=True)

    # -- audit and metrics -----------------------------------------------------------------

    def _count(self, sandbox: SandboxAddress | None, outcome: Outcome) -> None:
        result = outcome.error or outcome.decision
        metrics.child(metrics.DNS_QUERIES, sandbox.policy if sandbox else "-", result).inc()

    def _record(self, outcome: Outcome, sandbox: SandboxAddress | None,
                client: tuple[str, int], transport: str, started: float,
                queries: int | None = None) -> None:
        self._count(sandbox, outcome)
        host = outcome.host
        # The one audit record shape (gateway/core/audit.py), plus what only DNS has.
        record = audit_record(
            identity=None, client=client, listener="dns", method="DNS", scheme=None,
            host=host if host is None or len(host) <= MAX_SHOWN else host[:MAX_SHOWN] + "...",
            port=None, path=None, decision=outcome.decision, reason=outcome.reason,
            rule=outcome.rule, status=None, error=outcome.error, bytes_in=None,
            bytes_out=None, started=time.time() - (time.perf_counter() - started),
            path_taken="dns", engine="dns")
        record.update(sandbox=sandbox.sandbox if sandbox else None,
                      policy=sandbox.policy if sandbox else None, transport=transport,
                      qtype=outcome.qtype, rcode=outcome.rcode, answer=list(outcome.answer))
        if queries is not None:
            record["queries"] = queries  # refusals this line stands for (rate limit)
        self.auditor.write(record)

    # -- transports ------------------------------------------------------------------------

    async def _serve_tcp(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        """DNS over TCP: 2-byte length, message; several queries per connection."""
        if len(self._writers) >= TCP_CONNECTIONS:
            writer.close()
            return
        self._writers.add(writer)
        peer = writer.get_extra_info("peername")
        client = (str(peer[0]), int(peer[1])) if peer else ("?", 0)
        try:
            while True:
                async with asyncio.timeout(TCP_IDLE):
                    size = int.from_bytes(await reader.readexactly(2))
                    wire = await reader.readexactly(size)
                reply = await self.handle(wire, client, "tcp")
                if reply is None:
                    break
                writer.write(len(reply).to_bytes(2) + reply)
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()


class _UdpProtocol(asyncio.DatagramProtocol):
    """DNS over UDP: one datagram, one query, one reply (or none)."""

    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.DatagramTransport)
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        self.server.spawn(self._reply(data, (str(addr[0]), int(addr[1]))))

    def error_received(self, exc: Exception) -> None:
        """ICMP errors for earlier replies (client gone): nothing to do."""

    async def _reply(self, data: bytes, client: tuple[str, int]) -> None:
        reply = await self.server.handle(data, client, "udp")
        transport = self.transport
        if reply is not None and transport is not None and not transport.is_closing():
            transport.sendto(reply, client)
