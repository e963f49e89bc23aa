"""The aiohttp session of `TokenHttp`, in its own module so aiohttp is imported on the
first mint only (a gateway that mints nothing never loads it).

With `network.upstream_proxy` its connector dials through the proxy. aiohttp has no
public hook between resolving a name and connecting to the address: `ProxiedConnector`
overrides its `_wrap_create_connection`, checked against aiohttp 3.14 (`check_aiohttp`,
called at start when a proxy is set, refuses another version rather than dial direct)."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Mapping
from importlib.metadata import version
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from gateway.core.addresses import Pinned
from gateway.core.names import normalize_host

__all__ = ["ProxiedConnector", "check_aiohttp", "new_session"]

AIOHTTP_CHECKED = ("3.14.",)


class _OverrideResolver(AbstractResolver):
    """`network.resolve` first (`host:port`, then `host`), then the system resolver."""

    def __init__(self, overrides: Mapping[str, tuple[str, int]]) -> None:
        self._overrides = {k.lower(): v for k, v in overrides.items()}
        self._system = aiohttp.ThreadedResolver()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        name = host.lower().rstrip(".")
        found = self._overrides.get(f"{name}:{port}") or self._overrides.get(name)
        if found is None:
            return await self._system.resolve(host, port, family)
        ip, to_port = found
        return [{"hostname": host, "host": ip, "port": to_port,
                 "family": socket.AF_INET6 if ":" in ip else socket.AF_INET, "proto": 0,
                 "flags": socket.AI_NUMERICHOST}]

    async def close(self) -> None:
        await self._system.close()


def check_aiohttp() -> None:
    """Refuse an aiohttp `ProxiedConnector` was not checked against (RuntimeError)."""
    found = version("aiohttp")
    if not found.startswith(AIOHTTP_CHECKED):
        raise RuntimeError(
            f"aiohttp {found} is installed, but gateway/services/minting/aio.py's proxied "
            f"connector was checked against {', '.join(p + 'x' for p in AIOHTTP_CHECKED)}; "
            "install a supported version (pyproject.toml pins it) or re-check it")


class ProxiedConnector(aiohttp.TCPConnector):
    """A connector whose connections go through `proxy` (an `UpstreamProxy`) to the
    address aiohttp resolved (`network.resolve`, then DNS), the request's name kept for
    TLS, unless the proxy's no_proxy says direct; aiohttp's error translation kept."""

    def __init__(self, proxy: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._proxy = proxy

    async def _wrap_create_connection(self, *args: Any, addr_infos: list[Any], req: Any,
                                      timeout: Any, client_error: Any = None,
                                      **kw: Any) -> Any:
        error = client_error or aiohttp.ClientConnectorError
        sockaddr = addr_infos[0][4]
        pinned = Pinned(normalize_host(str(req.url.raw_host)), int(req.url.port),
                        str(sockaddr[0]), trusted=True, dial_port=int(sockaddr[1]))
        if not self._proxy.applies(pinned.host, pinned.ip, pinned.port):
            return await super()._wrap_create_connection(
                *args, addr_infos=addr_infos, req=req, timeout=timeout, client_error=error,
                **kw)
        tls = kw.get("ssl")
        try:
            return await self._proxy.open(
                pinned, args[0], timeout=timeout.sock_connect or timeout.total or 30.0,
                tls=tls if isinstance(tls, ssl.SSLContext) else None,
                server_hostname=kw.get("server_hostname") or pinned.host)
        except ssl.SSLCertVerificationError as exc:
            raise aiohttp.ClientConnectorCertificateError(req.connection_key, exc) from exc
        except ssl.SSLError as exc:
            raise aiohttp.ClientConnectorSSLError(req.connection_key, exc) from exc
        except OSError as exc:
            raise error(req.connection_key, exc) from exc


def new_session(overrides: Mapping[str, tuple[str, int]],
                context: ssl.SSLContext, proxy: Any = None) -> aiohttp.ClientSession:
    """A pooled session that verifies with `context` and resolves through `overrides`;
    with `proxy` (network.upstream_proxy), connecting through it to the resolved
    address. The gateway's own HTTPS_PROXY environment is never read (trust_env)."""
    options: dict[str, Any] = {"resolver": _OverrideResolver(overrides), "ssl": context,
                               "limit": 64}
    if proxy is not None:
        connector: aiohttp.TCPConnector = ProxiedConnector(proxy, **options)
    else:
        connector = aiohttp.TCPConnector(**options)
    return aiohttp.ClientSession(connector=connector, trust_env=False)
