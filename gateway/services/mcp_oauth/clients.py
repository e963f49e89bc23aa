"""The gateway's OAuth client at an MCP server's authorization server: one configured in
`mcp_oauth.clients` (its secret fetched from the secrets store), the gateway's client ID
metadata document (`mcp_oauth.client_metadata_url`), or a dynamic registration made
once for every process (under a lease in the state store) and kept."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from gateway.core.policy.mcp_rule import McpOAuth
from gateway.core.ports import Secrets
from gateway.services.mcp_oauth.discovery import ServerInfo
from gateway.services.mcp_oauth.grants import CLIENT, Grants
from gateway.services.mcp_oauth.http import OAuthError, OAuthHttp
from gateway.services.mcp_oauth.tokens import Client, register

__all__ = ["LEASE", "OAuthClients"]

LEASE = "mcp_oauth_lease"  # the record kind of a registration's (and a refresh's) lease


class OAuthClients:
    """Finds (or registers) the gateway's client at an authorization server."""

    def __init__(self, grants: Grants, http: OAuthHttp, secrets: Secrets, *,
                 redirect_url: str, named: Mapping[str, tuple[str, str | None]],
                 metadata_url: str | None, holder: str, clock: Callable[[], float]) -> None:
        self.grants = grants
        self.http = http
        self.secrets = secrets
        self.redirect_url = redirect_url
        self.named = dict(named)
        self.metadata_url = metadata_url
        self.holder = holder
        self.clock = clock

    async def of(self, info: ServerInfo, oauth: McpOAuth) -> Client:
        """The client `oauth` names at `info`'s authorization server: a configured
        one (its secret fetched), the gateway's client ID metadata document, or the
        dynamic registration made there."""
        if oauth.client != "auto":
            named = self.named.get(oauth.client)
            if named is None:
                raise OAuthError(f"client {oauth.client!r} is not in the gateway's "
                                 "mcp_oauth.clients")
            client_id, secret_name = named
            secret = None
            if secret_name is not None:
                try:
                    secret = (await self.secrets.get(secret_name)).reveal()
                except Exception:  # (SecretUnavailable, the store)
                    raise OAuthError(f"the secret {secret_name!r} of client "
                                     f"{oauth.client!r} could not be fetched") from None
            method = "none" if secret is None else "client_secret_basic" \
                if "client_secret_basic" in info.auth_methods else "client_secret_post"
            return Client(client_id, secret, method)
        if info.client_id_metadata and self.metadata_url:
            return Client(self.metadata_url)
        return await self.registered(info)

    async def registered(self, info: ServerInfo) -> Client:
        """The client dynamic registration made at `info`'s authorization server: made
        once (one process registers, under a lease, while requests held at the same
        time, here or on another process, wait for its record), then kept."""
        key = f"{info.issuer}|{self.redirect_url}"
        lease = f"register|{key}"
        for _ in range(150):
            known = await self.grants.get(CLIENT, key)
            if known is not None and known.secret is not None:
                return Client(str(known.doc["client_id"]), known.secret.get("secret"),
                              str(known.doc.get("auth_method", "none")))
            if await self.grants.store.record_put(LEASE, lease, {"holder": self.holder},
                                                  self.clock() + 20, None):
                break
            await asyncio.sleep(0.1)  # (another registers: its record is read next)
        else:
            raise OAuthError(f"the gateway's registration at {info.issuer} did not "
                             "complete in time")
        try:
            known = await self.grants.get(CLIENT, key)
            if known is not None and known.secret is not None:
                return Client(str(known.doc["client_id"]), known.secret.get("secret"),
                              str(known.doc.get("auth_method", "none")))
            client = await register(self.http, info, self.redirect_url)
            await self.grants.put(CLIENT, key, {"client_id": client.client_id,
                                                "auth_method": client.auth_method},
                                  {"secret": client.secret}, self.clock() + 365 * 86400.0,
                                  None if known is None else known.rev)
            return client
        finally:
            found = await self.grants.store.record_get(LEASE, lease)
            if found is not None and found[0].get("holder") == self.holder:
                await self.grants.store.record_put(LEASE, lease, found[0], self.clock(),
                                                   found[1])

    def metadata(self) -> dict[str, Any] | None:
        """The gateway's client ID metadata document, for `mcp_oauth.client_metadata_url`
        to publish (None: no such URL configured): a public client (PKCE) whose only
        redirect URI is the gateway's callback."""
        if not self.metadata_url:
            return None
        return {"client_id": self.metadata_url, "client_name": "sandbox-gateway",
                "redirect_uris": [self.redirect_url],
                "grant_types": ["authorization_code", "refresh_token"],
                "response_types": ["code"], "token_endpoint_auth_method": "none"}
