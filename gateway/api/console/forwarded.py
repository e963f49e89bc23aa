"""How the browser reached the console, behind a reverse proxy or not
(`console.trusted_proxies`).

A TLS-terminating proxy talks plain HTTP to the admin listener: the scheme and host the
browser used arrive as `X-Forwarded-Proto` and `X-Forwarded-Host` (and its address as
`X-Forwarded-For`). They are believed only from a peer whose address is in
`console.trusted_proxies` (default 127.0.0.1 and ::1), and only as one well-formed
value (one header line, no list): anything else is ignored and the request's own scheme,
`Host` and peer address stand. What this says decides the session cookie's `Secure`
flag and the origin a sign-in or form POST must come from. The admin listener's uvicorn
reads no forwarded header itself (`proxy_headers` off): this is the one reading.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.requests import Request

__all__ = ["DEFAULT_TRUSTED", "Seen", "TrustedProxies"]

DEFAULT_TRUSTED = ("127.0.0.1", "::1")
_HOST = re.compile(r"(?:\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?)"
                   r"(?::[0-9]{1,5})?")
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Seen:
    """The scheme and host (`host[:port]`) the browser used, and its address."""

    scheme: str
    host: str
    client: str | None
    forwarded: bool  # (said by a trusted proxy)

    @property
    def origin(self) -> str:
        """The `Origin` a browser sends from the console's own pages."""
        return f"{self.scheme}://{self.host}"


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        found = ipaddress.ip_address(text.strip().removeprefix("[").split("]")[0])
    except ValueError:
        return None
    if isinstance(found, ipaddress.IPv6Address) and found.ipv4_mapped is not None:
        return found.ipv4_mapped
    return found


class TrustedProxies:
    """The peers whose forwarded headers are believed (validated by the config)."""

    def __init__(self, networks: Sequence[str] = DEFAULT_TRUSTED) -> None:
        self.networks: tuple[Network, ...] = tuple(
            ipaddress.ip_network(n, strict=False) for n in networks)

    def trusts(self, address: str | None) -> bool:
        found = _address(address) if address else None
        return found is not None and any(found in net for net in self.networks)

    def seen(self, request: Request) -> Seen:
        """How the browser reached this request (see the module docstring)."""
        peer = request.client.host if request.client else None
        own = Seen(request.url.scheme, request.headers.get("host") or request.url.netloc,
                   peer, False)
        if not self.trusts(peer):
            return own
        proto = _one(request, "x-forwarded-proto")
        host = _one(request, "x-forwarded-host")
        scheme = proto.lower() if proto and proto.lower() in ("http", "https") else own.scheme
        shown = host if host and _HOST.fullmatch(host) else own.host
        return Seen(scheme, shown, self._client(request) or peer,
                    scheme != own.scheme or shown != own.host)

    def _client(self, request: Request) -> str | None:
        """The browser's address in `X-Forwarded-For`: the last one no trusted proxy
        added (None: none usable)."""
        hops = [h.strip() for v in request.headers.getlist("x-forwarded-for")
                for h in v.split(",")]
        for hop in reversed(hops):
            found = _address(hop)
            if found is None:
                return None
            if not any(found in net for net in self.networks):
                return str(found)
        return None


def _one(request: Request, name: str) -> str | None:
    """A header's value if it came once, as one value (no list); else None."""
    values = request.headers.getlist(name)
    if len(values) != 1 or "," in values[0]:
        return None
    return values[0].strip() or None
