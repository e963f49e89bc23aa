"""The aiohttp session of `TokenHttp`, in its own module so aiohttp is imported on the
first mint only (a gateway that mints nothing never loads it)."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

__all__ = ["new_session"]


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


def new_session(overrides: Mapping[str, tuple[str, int]],
                context: ssl.SSLContext, proxy: Any = None) -> aiohttp.ClientSession:
    """A pooled session that verifies with `context` and resolves through `overrides`;
    with `proxy` (network.upstream_proxy), connecting through it to the resolved
    address. The gateway's own HTTPS_PROXY environment is never read (trust_env)."""
    options: dict[str, Any] = {"resolver": _OverrideResolver(overrides), "ssl": context,
                               "limit": 64}
    if proxy is not None:
        from gateway.engines.patches import proxied_connector

        connector: aiohttp.TCPConnector = proxied_connector(proxy, **options)
    else:
        connector = aiohttp.TCPConnector(**options)
    return aiohttp.ClientSession(connector=connector, trust_env=False)
