"""A real MCP server requiring OAuth (the official SDK's FastMCP with its bearer-token
middleware and protected-resource metadata) and its authorization server (the SDK's
authorization routes over a small in-memory `OAuthAuthorizationServerProvider`: dynamic
registration, PKCE, resource indicators, refresh-token rotation, revocation), one
process over TLS, for the `mcp.oauth` tests.

Run with the MCP SDK's Python (helpers/python_clients.py `mcp_python`):
    python mcp_oauth_server.py HOST PORT CERT KEY LOG_FILE TOKEN_TTL

The MCP server is https://mcp.test/mcp (it needs scope `mcp`), the authorization server
https://auth.test (both names resolved to this port by the gateway's network.resolve).
`authorize` consents at once (the person who signs in, in these tests) and redirects to
the client's redirect URI. Every event is appended to LOG_FILE as a JSON line (register,
authorize, token, refresh, revoke, call: with the client, scopes, resource and the token
that was used), so a test sees what reached the servers. `POST /test/forget-access` makes
the authorization server forget every access token (a 401 follows). Prints `ready` once
it listens.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from typing import Any

import uvicorn
from mcp.server.auth.provider import (
    AccessToken,
    AuthorizationCode,
    AuthorizationParams,
    RefreshToken,
    construct_redirect_uri,
)
from mcp.server.auth.settings import AuthSettings, ClientRegistrationOptions, RevocationOptions
from mcp.server.fastmcp import FastMCP
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.auth import OAuthClientInformationFull, OAuthToken
from starlette.requests import Request
from starlette.responses import Response

host, port, cert, key, log_file, ttl = sys.argv[1:7]
TTL = int(ttl)


def _log(event: str, **fields: Any) -> None:
    with open(log_file, "a", encoding="utf-8") as out:
        out.write(json.dumps({"event": event, **fields}) + "\n")


class Provider:
    """In memory, one process: clients, codes, tokens."""

    def __init__(self) -> None:
        self.clients: dict[str, OAuthClientInformationFull] = {}
        self.codes: dict[str, AuthorizationCode] = {}
        self.access: dict[str, AccessToken] = {}
        self.refresh: dict[str, RefreshToken] = {}

    async def get_client(self, client_id: str) -> OAuthClientInformationFull | None:
        return self.clients.get(client_id)

    async def register_client(self, client_info: OAuthClientInformationFull) -> None:
        assert client_info.client_id is not None
        self.clients[client_info.client_id] = client_info
        _log("register", client=client_info.client_id,
             redirect_uris=[str(u) for u in client_info.redirect_uris or []],
             auth_method=client_info.token_endpoint_auth_method,
             secret=client_info.client_secret)

    async def authorize(self, client: OAuthClientInformationFull,
                        params: AuthorizationParams) -> str:
        code = secrets.token_urlsafe(24)
        assert client.client_id is not None
        self.codes[code] = AuthorizationCode(
            code=code, scopes=params.scopes or [], expires_at=time.time() + 300,
            client_id=client.client_id, code_challenge=params.code_challenge,
            redirect_uri=params.redirect_uri,
            redirect_uri_provided_explicitly=params.redirect_uri_provided_explicitly,
            resource=params.resource)
        _log("authorize", client=client.client_id, scopes=params.scopes,
             resource=params.resource, code=code)
        return construct_redirect_uri(str(params.redirect_uri), code=code, state=params.state)

    async def load_authorization_code(self, client: OAuthClientInformationFull,
                                      authorization_code: str) -> AuthorizationCode | None:
        return self.codes.get(authorization_code)

    def _issue(self, client_id: str, scopes: list[str], resource: str | None) -> OAuthToken:
        access, refresh = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        self.access[access] = AccessToken(token=access, client_id=client_id, scopes=scopes,
                                          expires_at=int(time.time()) + TTL,
                                          resource=resource)
        self.refresh[refresh] = RefreshToken(token=refresh, client_id=client_id,
                                             scopes=scopes, resource=resource)
        return OAuthToken(access_token=access, expires_in=TTL, scope=" ".join(scopes),
                          refresh_token=refresh)

    async def exchange_authorization_code(self, client: OAuthClientInformationFull,
                                          authorization_code: AuthorizationCode) -> OAuthToken:
        del self.codes[authorization_code.code]
        assert client.client_id is not None
        issued = self._issue(client.client_id, authorization_code.scopes,
                             authorization_code.resource)
        _log("token", client=client.client_id, scopes=authorization_code.scopes,
             resource=authorization_code.resource, access=issued.access_token,
             refresh=issued.refresh_token)
        return issued

    async def load_refresh_token(self, client: OAuthClientInformationFull,
                                 refresh_token: str) -> RefreshToken | None:
        return self.refresh.get(refresh_token)

    async def exchange_refresh_token(self, client: OAuthClientInformationFull,
                                     refresh_token: RefreshToken,
                                     scopes: list[str]) -> OAuthToken:
        del self.refresh[refresh_token.token]  # (rotated: the old one is spent)
        assert client.client_id is not None
        issued = self._issue(client.client_id, scopes or refresh_token.scopes,
                             refresh_token.resource)
        _log("refresh", client=client.client_id, resource=refresh_token.resource,
             access=issued.access_token, refresh=issued.refresh_token)
        return issued

    async def load_access_token(self, token: str) -> AccessToken | None:
        found = self.access.get(token)
        _log("verify", access=token, known=found is not None,
             resource=found.resource if found else None)
        return found

    async def revoke_token(self, token: AccessToken | RefreshToken) -> None:
        self.access.pop(token.token, None)
        self.refresh.pop(token.token, None)
        _log("revoke", kind=type(token).__name__)


provider = Provider()
server = FastMCP(
    "issues", auth_server_provider=provider,
    auth=AuthSettings(
        issuer_url="https://auth.test", resource_server_url="https://mcp.test/mcp",
        required_scopes=["mcp"], validate_token_resource=True,
        client_registration_options=ClientRegistrationOptions(
            enabled=True, valid_scopes=["mcp", "profile"], default_scopes=["mcp"]),
        revocation_options=RevocationOptions(enabled=True)),
    transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))


@server.custom_route("/test/forget-access", methods=["POST"])
async def forget_access(request: Request) -> Response:
    """The authorization server forgets every access token it issued (what an expiry
    or a revocation elsewhere does): the next call with one is refused 401."""
    provider.access.clear()
    _log("forget-access")
    return Response(status_code=204)


@server.tool()
def search_issues(query: str) -> str:
    """Search the issues."""
    _log("call", tool="search_issues")
    return f"found 2 issues for {query}"


@server.tool()
def whoami() -> str:
    """What the server knows of the caller (never its token)."""
    from mcp.server.auth.middleware.auth_context import get_access_token

    token = get_access_token()
    _log("call", tool="whoami", access=token.token if token else None)
    return f"client {token.client_id if token else None}"


config = uvicorn.Config(server.streamable_http_app(), host=host, port=int(port),
                        ssl_certfile=cert, ssl_keyfile=key, log_level="warning",
                        lifespan="on")
uv = uvicorn.Server(config)
config.load()
print("ready", flush=True)
uv.run()
