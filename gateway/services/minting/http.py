"""The gateway's own HTTPS client for token endpoints (GitHub, Entra ID, STS, Google, OAuth2).

These endpoints are configured by the operator (policy fields `api_url`, `token_url`,
`authority`, `sts_url`), not chosen by a sandbox, so the calls run under
`resolver.unguarded()`. They verify TLS against the public roots plus
`network.upstream_ca`, honour `network.resolve` (the operator's name overrides, the
same the gateway dials upstreams by), go through `network.upstream_proxy` when one is
set (to the address resolved here, as every upstream dial), never follow redirects,
bound the reply size and time out. Failures become `MintFailed` with a fixed
sentence, never reply bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.net.resolver import unguarded
from gateway.net.roots import public_roots, verifying_context
from gateway.services.minting.errors import MintFailed

if TYPE_CHECKING:  # (aiohttp is imported on the first mint: 7 MB a process saves otherwise)
    import aiohttp

__all__ = ["MAX_REPLY", "Reply", "TokenHttp"]

MAX_REPLY = 1024 * 1024  # a token endpoint's answer is small; more is refused


@dataclass(frozen=True, slots=True)
class Reply:
    """A token endpoint's answer (header names lower-cased)."""

    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        """The body as JSON (raises ValueError)."""
        return json.loads(self.body)

    def retry_after(self) -> float | None:
        raw = self.headers.get("retry-after", "")
        return float(raw) if raw.isdigit() else None


class TokenHttp:
    """One connection pool for every token endpoint; the session is made lazily on
    the gateway's event loop."""

    def __init__(self, *, upstream_ca: Path | None = None,
                 overrides: Mapping[str, tuple[str, int]] | None = None,
                 timeout: float = 15.0, connect_timeout: float = 10.0,
                 connector: Callable[..., Any] | None = None) -> None:
        self.context = verifying_context(*public_roots(upstream_ca))
        self.overrides = dict(overrides or {})
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        # network.upstream_proxy: makes the session's connector (patches.proxied_connector)
        self.connector = connector
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            from gateway.services.minting.aio import new_session

            self._session = new_session(self.overrides, self.context, self.connector)
        return self._session

    async def request(self, method: str, url: str, *,
                      headers: Mapping[str, str] | None = None,
                      data: bytes | None = None) -> Reply:
        """One request; raises MintFailed (transient) when the endpoint cannot be reached
        or does not answer in time."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout, sock_connect=self.connect_timeout)
        where = url.split("?", 1)[0]
        try:
            with unguarded():
                async with self.session().request(
                        method, url, headers=dict(headers or {}), data=data,
                        allow_redirects=False, timeout=timeout) as response:
                    status = response.status
                    fields = {k.lower(): v for k, v in response.headers.items()}
                    body = b""
                    async for chunk in response.content.iter_chunked(64 * 1024):
                        body += chunk
                        if len(body) > MAX_REPLY:
                            break
        except TimeoutError:
            raise MintFailed(f"{where} did not answer within {self.timeout:g}s",
                             transient=True) from None
        except aiohttp.ClientConnectorCertificateError:
            raise MintFailed(f"the TLS certificate of {where} is not trusted (add its CA "
                             "to network.upstream_ca if it uses a private one)") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise MintFailed(f"could not reach {where} ({type(exc).__name__})",
                             transient=True) from None
        if len(body) > MAX_REPLY:
            raise MintFailed(f"{where} answered with more than {MAX_REPLY} bytes")
        return Reply(status, fields, body)

    def azure_transport(self) -> Any:
        """An azure-core transport over this client's session (TLS, overrides)."""
        from azure.core.pipeline.transport import AioHttpTransport

        return AioHttpTransport(session=self.session(), session_owner=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
