"""Connection admission: a CONNECT, a redirected connection (transparent mode), the first
bytes of an admitted tunnel, and a tunnel's one audit line when it ends.

A CONNECT is read, its client identified by its proxy credentials, decided at tunnel
level (`Asking.decide`: host and port; ask mode included), and its destination checked
and pinned. A redirected connection is decided on the name its first bytes give (SNI,
Host), which must resolve to the address it was sent to. Every refusal raises
`Refused` with its one audit line written.
"""

from __future__ import annotations

from gateway.core import target
from gateway.core.addresses import Pinned
from gateway.core.client import Client, Refused, Tunnel
from gateway.core.local_api import INTERNAL_HOST
from gateway.core.messages import RequestHead
from gateway.core.names import DestinationError, is_ip, normalize_host
from gateway.core.policy import Decision, Request
from gateway.core.refusal import GATEWAY_ERROR, Answer, Refusal, answered_inside_tls
from gateway.core.trail import rule_of
from gateway.pipeline.asking import Asking
from gateway.pipeline.identify import UNREGISTERED
from gateway.pipeline.parts import Parts

__all__ = ["Tunnels", "plain_client"]


class Tunnels:
    """Admits tunnels and redirected connections; audits each tunnel once."""

    def __init__(self, parts: Parts, asking: Asking) -> None:
        self.parts = parts
        self.asking = asking

    async def connect(self, client: Client, authority: str, proxy_authorization: str | None,
                      *, started: float | None = None) -> Tunnel:
        """Admit a CONNECT: read its authority, identify the client by its proxy
        credentials, decide the tunnel (policy at tunnel level), check and pin the
        destination. Raises Refused (audited, with the answer to send; `inside` set
        where the refusal is to be answered inside TLS, `refusals.inside_tls`)."""
        parts = self.parts
        host: str | None = None
        port: int | None = None
        try:
            unreadable: Refusal | None = None
            try:  # (read first: a token's refusal names the host, and can go inside TLS)
                host, port = target.tunnel_authority(authority)
            except Refusal as refused:
                unreadable = refused
            parts.identities.identify(client, proxy_authorization)
            if unreadable is not None or host is None or port is None:
                raise unreadable or GATEWAY_ERROR
            parts.check_health()
            return await self._admit(client, host, port)
        except Refusal as refusal:
            answer = parts.trail.refuse(client, refusal, method="CONNECT", host=host,
                                        port=port, started=started, close=True)
            inside = host if (parts.refusals_inside_tls and host is not None
                              and answered_inside_tls(refusal.code)) else None
            raise Refused(refusal, answer, inside) from None
        except Exception:
            raise parts.crashed(client, method="CONNECT", host=host, port=port) from None

    def answer_inside(self, refused: Refused, head: RequestHead) -> Answer:
        """The answer to a refused CONNECT for the request that came inside its TLS (the
        refusal's one audit line was written at the CONNECT): in the provider's error
        shape on its host, as text for git, and the connection closes."""
        return self.parts.trail.render(refused.refusal, refused.inside,
                                       plain=plain_client(head))

    async def _admit(self, client: Client, host: str, port: int) -> Tunnel:
        assert client.identity is not None
        decision = (await self.asking.decide(client, client.identity,
                                             Request(None, "https", host, port, None))).decision
        tcp = decision.rule is not None and decision.rule.protocol == "tcp"
        # A would-deny tunnel (report mode) is inspected, so its requests are recorded.
        passthrough = tcp or (decision.result == "allow" and not decision.inspect)
        pinned = (None if host == INTERNAL_HOST
                  else await self.parts.destination(client, host, port))
        tunnel = Tunnel(host, port, decision, pinned, passthrough, tcp,
                        self.parts.trail.clock())
        client.tunnel = tunnel
        return tunnel

    def identify_registered(self, client: Client, orig: tuple[str, int]) -> bool:
        """Transparent mode: identify a redirected connection (to `orig`) by its
        registered source address; False if it is not registered. Raises Refused
        (audited) past its sandbox's connection limit."""
        try:
            return self.parts.identities.identify_registered(client)
        except Refusal as refusal:
            raise Refused(refusal, self.parts.trail.refuse(
                client, refusal, host=orig[0], port=orig[1], close=True)) from None

    async def open_transparent(self, client: Client, orig: tuple[str, int], kind: str,
                               name: str | None) -> Tunnel:
        """Admit a redirected connection from its first bytes: `kind` is `tls`, `http`
        or `tcp`, `name` the SNI or Host it gives. The name must resolve to the original
        address (a sandbox may not pair an allowed name with another address); the
        original address is checked like any destination. Raises Refused (audited)."""
        orig_ip, port = orig
        host: str | None = None
        try:
            self.parts.check_health()
            host = _server_name(client, orig_ip, port, kind, name)
            pinned = Pinned(host, port, orig_ip, trusted=True)
            tunnel = await self._redirected(client, pinned, kind)
            client.tunnel = tunnel
            client.pins[(host, port)] = pinned
            # (the original address too: mitmproxy dials a redirected connection by it)
            client.pins[(normalize_host(orig_ip), port)] = pinned
            return tunnel
        except Refusal as refusal:
            raise Refused(refusal, self.parts.trail.refuse(
                client, refusal, host=host or orig_ip, port=port, close=True)) from None
        except Exception:
            raise self.parts.crashed(client, method=None, host=host or orig_ip,
                                     port=port) from None

    async def _redirected(self, client: Client, pinned: Pinned, kind: str) -> Tunnel:
        """The tunnel of a redirected connection to `pinned.host` (its name), sent to
        `pinned.ip`: decided on the name (the policy first: a denied name is never even
        resolved), then the name bound to the address."""
        host, orig_ip, port = pinned.host, pinned.ip, pinned.port
        clock = self.parts.trail.clock
        if client.identity is None:
            # Unregistered: identity comes per request from a token in a key carrier,
            # which needs the request: intercept, decide per request.
            if kind != "tls" and kind != "http":
                raise UNREGISTERED
            await self._bind(host, orig_ip, port)
            return Tunnel(host, port, Decision("allow", "identified per request", None, True),
                          pinned, False, False, clock())
        scheme = "tcp" if kind == "tcp" else "https" if kind == "tls" else "http"
        decision = (await self.asking.decide(client, client.identity, Request(
            None, scheme, host, port, None))).decision
        await self._bind(host, orig_ip, port)
        tcp = kind == "tcp" or (decision.rule is not None and decision.rule.protocol == "tcp")
        # Plain HTTP is always inspected: every request's Host is checked.
        passthrough = tcp or (kind == "tls" and decision.result == "allow"
                              and not decision.inspect)
        return Tunnel(host, port, decision, pinned, passthrough, tcp, clock())

    async def _bind(self, host: str, orig_ip: str, port: int) -> None:
        """Refuse pairing `host` with `orig_ip` unless the name resolves to it; then the
        address itself must pass the destination check."""
        guard = self.parts.guard
        if host != orig_ip:
            try:
                pinned: Pinned | None = await guard.check(host, port)
            except Refusal as refused:
                if refused.code != "forbidden_destination":
                    raise
                pinned = None
            if pinned is not None and pinned.trusted:
                answers = {pinned.ip}
            else:
                try:
                    answers = {normalize_host(ip)
                               for ip in await self.parts.resolve(host, port)}
                except (OSError, DestinationError):
                    answers = set()
            if orig_ip not in answers:
                raise Refusal("host_mismatch", f"{host} does not resolve to the connection's "
                              f"address {orig_ip}; a sandbox may not pair an allowed name "
                              "with another address")
            if pinned is not None and pinned.trusted:
                return
        await guard.check(orig_ip, port)

    def check_hello(self, client: Client, sni: str | None, *, tls: bool) -> None:
        """The first bytes of an admitted tunnel: a passthrough tunnel must carry TLS
        (unless `protocol: tcp`) and every TLS tunnel's server name must be its host.
        Raises Refused (audited)."""
        tunnel = client.tunnel
        assert tunnel is not None
        try:
            refusal = _hello_refusal(tunnel, sni, tls)
        except Exception:
            raise self.parts.crashed(client, method="CONNECT", host=tunnel.host,
                                     port=tunnel.port) from None
        if refusal is not None:
            raise Refused(refusal, self.parts.trail.refuse(
                client, refusal, method="CONNECT", host=tunnel.host, port=tunnel.port,
                started=tunnel.started, close=True))

    def closed(self, client: Client, bytes_in: int | None, bytes_out: int | None,
               error: str | None = None) -> None:
        """A tunnel ended (idempotent): a passthrough tunnel's one line, for its decision
        and traffic; an inspected tunnel's only if no line was written for it (closed
        before any request: `error` says how, default `no_request`). So every tunnel
        answered 200 is on the audit trail, tunnels that never carried a byte included."""
        tunnel = client.tunnel
        if tunnel is None:
            return
        client.tunnel = None
        if not tunnel.passthrough:
            if tunnel.audited:
                return
            error = error or "no_request"
        self.parts.telemetry.count("bytes", "in", by=bytes_in or 0)
        self.parts.trail.audit(
            client, decision=tunnel.decision.result, reason=tunnel.decision.reason,
            rule=rule_of(tunnel.decision), method="CONNECT", host=tunnel.host,
            port=tunnel.port, status=200, error=error, bytes_in=bytes_in,
            bytes_out=bytes_out, started=tunnel.started,
            path_taken="passthrough" if tunnel.passthrough else "intercept")


def _server_name(client: Client, orig_ip: str, port: int, kind: str,
                 name: str | None) -> str:
    """The normalised name a redirected connection is decided on (raises Refusal)."""
    if kind == "tcp":
        if not client.registered:
            raise Refusal("unknown_sandbox", "raw TCP from an unregistered source: "
                          "register the sandbox with POST /v1/sandboxes")
        name = orig_ip
    elif kind == "tls" and not name and is_ip(orig_ip):
        name = orig_ip  # TLS to an address carries no SNI: the address is the name
    if not name:
        raise Refusal("bad_destination", "no server name ("
                      f"{'SNI' if kind == 'tls' else 'Host'}) to decide on; clients "
                      "must send one")
    try:
        return normalize_host(name if kind != "http" else
                              target.tunnel_authority(_with_port(name, port))[0])
    except (DestinationError, Refusal) as exc:
        raise Refusal("bad_destination", f"bad server name: {exc}") from None


def _hello_refusal(tunnel: Tunnel, sni: str | None, tls: bool) -> Refusal | None:
    if not tls:
        if tunnel.passthrough and not tunnel.tcp:
            return Refusal("policy_denied", f"non-TLS bytes in a tunnel to "
                           f"{tunnel.host}:{tunnel.port}; add protocol: tcp to the rule "
                           "to allow raw TCP", rule_of(tunnel.decision))
        return None
    if tunnel.tcp:
        return None
    return target.check_server_name(tunnel.host, sni, passthrough=tunnel.passthrough)


def plain_client(head: RequestHead) -> bool:
    """The client shows only a text/plain body of an error (git: as "remote:" lines)."""
    return (head.headers.get("user-agent") or "").startswith("git/")


def _with_port(name: str, port: int) -> str:
    """`host` or `host:port` (a Host header) as an authority with a port."""
    if name.endswith("]") or name.count(":") == 0:
        return f"{name}:{port}"
    return name
