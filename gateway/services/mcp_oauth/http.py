"""The gateway's HTTP client for MCP servers' OAuth endpoints (protected-resource and
authorization-server metadata, registration, authorization codes and refresh tokens).

These URLs come from the servers' own metadata, not from the operator, so every request
goes through the destination guard like a sandbox's (`Guard.check`: private ranges,
metadata addresses and the gateway's own listeners refused; `network.resolve` honoured)
and dials the address it chose; only `https` is spoken, TLS verified against the public
roots plus `network.upstream_ca`; no redirect is followed; answers are bounded in size
and time. A failure is an `OAuthError` in fixed sentences (never the servers' bytes).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from gateway.core.ports import Guard
from gateway.core.refusal import Refusal
from gateway.net.resolver import unguarded
from gateway.services.minting.http import MAX_REPLY, Reply

__all__ = ["OAuthError", "OAuthHttp"]


class OAuthError(Exception):
    """Obtaining a token failed; the message is shown (fixed sentences and names)."""


class OAuthHttp:
    """See the module docstring; `connector` makes aiohttp connectors (the upstream
    proxy's, `network.upstream_proxy`)."""

    def __init__(self, guard: Guard, context: ssl.SSLContext, *, timeout: float = 15.0,
                 connector: Callable[..., Any] | None = None) -> None:
        self.guard = guard
        self.context = context
        self.timeout = timeout
        self.connector = connector

    async def request(self, method: str, url: str, *, headers: Mapping[str, str] | None = None,
                      data: bytes | None = None) -> Reply:
        import aiohttp

        from gateway.services.minting.aio import new_session

        parts = urlsplit(url)
        if parts.scheme != "https" or not parts.hostname:
            raise OAuthError(f"{_where(url)} is not an https URL")
        port = parts.port or 443
        try:
            pinned = await self.guard.check(parts.hostname, port)
        except Refusal as refusal:
            raise OAuthError(f"{_where(url)} is refused: {refusal.reason}") from None
        session = new_session({f"{parts.hostname}:{port}": pinned.address}, self.context,
                              self.connector)
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        try:
            with unguarded():  # (the guard above chose the one address dialled)
                async with session.request(method, url, headers=dict(headers or {}),
                                           data=data, allow_redirects=False,
                                           timeout=timeout) as response:
                    fields = {k.lower(): v for k, v in response.headers.items()}
                    body = await response.content.read(MAX_REPLY + 1)
                    status = response.status
        except TimeoutError:
            raise OAuthError(f"{_where(url)} did not answer within {self.timeout:g}s") from None
        except aiohttp.ClientConnectorCertificateError:
            raise OAuthError(f"the TLS certificate of {_where(url)} is not trusted") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise OAuthError(f"could not reach {_where(url)} ({type(exc).__name__})") from None
        finally:
            await session.close()
        if len(body) > MAX_REPLY:
            raise OAuthError(f"{_where(url)} answered with more than {MAX_REPLY} bytes")
        return Reply(status, fields, body)

    async def get_json(self, url: str) -> dict[str, Any] | None:
        """A metadata document (None: not there, 4xx)."""
        reply = await self.request("GET", url, headers={"Accept": "application/json"})
        if 400 <= reply.status < 500:
            return None
        return _json(reply, url)

    async def post(self, url: str, body: bytes, content_type: str,
                   headers: Mapping[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        """(status, JSON answer) of a POST (a token or registration endpoint)."""
        reply = await self.request("POST", url, data=body, headers={
            "Content-Type": content_type, "Accept": "application/json",
            "User-Agent": "sandbox-gateway", **(headers or {})})
        return reply.status, _json(reply, url, ok_statuses=range(200, 500))


def _json(reply: Reply, url: str, ok_statuses: range = range(200, 300)) -> dict[str, Any]:
    if reply.status not in ok_statuses:
        raise OAuthError(f"{_where(url)} answered {reply.status}")
    try:
        doc = json.loads(reply.body)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise OAuthError(f"{_where(url)} answered {reply.status} without a JSON object")
    return doc


def _where(url: str) -> str:
    """A URL as a reason shows it: scheme, host and path, never its query."""
    return url.split("?", 1)[0][:200]
