"""The aiohttp session of `TokenHttp`, in its own module so aiohttp is imported on the
first mint only (a gateway that mints nothing never loads it).

With `network.upstream_proxy` its connector (made by the factory the runtime passes:
`engines/patches.proxied_connector`, where the private aiohttp hook it needs lives,
version-checked) dials through the proxy."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable, Mapping

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


def new_session(overrides: Mapping[str, tuple[str, int]], context: ssl.SSLContext,
                connector: Callable[..., aiohttp.TCPConnector] | None = None
                ) -> aiohttp.ClientSession:
    """A pooled session that verifies with `context` and resolves through `overrides`;
    its connector made by `connector` (network.upstream_proxy: through the proxy to the
    resolved address). The gateway's own HTTPS_PROXY environment is never read."""
    make = connector or aiohttp.TCPConnector
    return aiohttp.ClientSession(connector=make(resolver=_OverrideResolver(overrides),
                                                ssl=context, limit=64), trust_env=False)
