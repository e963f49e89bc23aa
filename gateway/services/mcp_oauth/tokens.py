"""OAuth 2.1 with an MCP server's authorization server: the client the gateway is
(a client ID metadata document, dynamic registration RFC 7591, or a configured client),
the authorization URL a person opens (PKCE S256, `state`, the `resource` indicator of
RFC 8707), the code exchanged and tokens refreshed (the `resource` again) and revoked
(RFC 7009, where the server has an endpoint for it)."""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from gateway.services.mcp_oauth.discovery import ServerInfo
from gateway.services.mcp_oauth.http import OAuthError, OAuthHttp

__all__ = ["Client", "TokenSet", "authorization_url", "exchange", "pkce", "refresh",
           "register", "revoke"]


@dataclass(frozen=True, slots=True)
class Client:
    """The gateway's client at one authorization server (`secret` None: public)."""

    client_id: str
    secret: str | None = None
    auth_method: str = "none"  # none, client_secret_basic or client_secret_post


@dataclass(frozen=True, slots=True)
class TokenSet:
    access: str
    refresh: str | None
    expires_at: float | None
    scopes: tuple[str, ...]


def pkce() -> tuple[str, str]:
    """(verifier, S256 challenge)."""
    verifier = secrets.token_urlsafe(48)
    digest = hashlib.sha256(verifier.encode()).digest()
    return verifier, base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


async def register(http: OAuthHttp, info: ServerInfo, redirect_url: str) -> Client:
    """Dynamic client registration (RFC 7591): a public client (PKCE), or a confidential
    one where the server only takes those; registered for every scope the resource and
    its authorization server name (a server may hold a client to them)."""
    if info.registration_endpoint is None:
        raise OAuthError(f"the authorization server {info.issuer} has no registration "
                         "endpoint and supports no client ID metadata document; configure "
                         "a client (mcp_oauth.clients) and name it in mcp.oauth.client")
    method = "none" if "none" in info.auth_methods else "client_secret_post"
    doc = {"client_name": "sandbox-gateway", "redirect_uris": [redirect_url],
           "grant_types": ["authorization_code", "refresh_token"],
           "response_types": ["code"], "token_endpoint_auth_method": method}
    scopes = dict.fromkeys(info.scopes_supported + info.server_scopes)
    if scopes:
        doc["scope"] = " ".join(scopes)
    status, answer = await http.post(info.registration_endpoint, json.dumps(doc).encode(),
                                     "application/json")
    client_id = answer.get("client_id")
    if status not in (200, 201) or not isinstance(client_id, str) or not client_id:
        raise OAuthError(f"the registration endpoint of {info.issuer} answered {status}"
                         f"{_error(answer)}")
    secret = answer.get("client_secret")
    return Client(client_id, secret if isinstance(secret, str) and secret else None,
                  str(answer.get("token_endpoint_auth_method") or method))


def authorization_url(info: ServerInfo, client: Client, redirect_url: str,
                      scopes: tuple[str, ...], state: str, challenge: str) -> str:
    query = {"response_type": "code", "client_id": client.client_id,
             "redirect_uri": redirect_url, "state": state, "code_challenge": challenge,
             "code_challenge_method": "S256", "resource": info.resource}
    if scopes:
        query["scope"] = " ".join(scopes)
    joiner = "&" if "?" in info.authorization_endpoint else "?"
    return info.authorization_endpoint + joiner + urlencode(query, quote_via=quote)


async def _token_request(http: OAuthHttp, info: ServerInfo, client: Client,
                         form: dict[str, str], asked: tuple[str, ...]) -> TokenSet:
    headers: dict[str, str] = {}
    form = {**form, "resource": info.resource}
    if client.secret is not None and client.auth_method == "client_secret_basic":
        pair = f"{quote(client.client_id, safe='')}:{quote(client.secret, safe='')}"
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
    else:
        form["client_id"] = client.client_id
        if client.secret is not None:
            form["client_secret"] = client.secret
    status, answer = await http.post(info.token_endpoint, urlencode(form).encode(),
                                     "application/x-www-form-urlencoded", headers)
    token = answer.get("access_token")
    if status != 200 or not isinstance(token, str) or not token:
        raise OAuthError(f"the token endpoint of {info.issuer} answered {status}"
                         f"{_error(answer)}")
    if str(answer.get("token_type", "")).lower() != "bearer":
        raise OAuthError(f"the token endpoint of {info.issuer} answered a token that is "
                         "not a bearer token")
    expires_in = answer.get("expires_in")
    expires_at = time.time() + float(expires_in) if isinstance(expires_in, int | float) \
        and not isinstance(expires_in, bool) and expires_in > 0 else None
    granted = answer.get("scope")
    rotated = answer.get("refresh_token")
    return TokenSet(token, rotated if isinstance(rotated, str) and rotated else None,
                    expires_at, tuple(granted.split()) if isinstance(granted, str) else asked)


async def exchange(http: OAuthHttp, info: ServerInfo, client: Client, code: str,
                   verifier: str, redirect_url: str, asked: tuple[str, ...]) -> TokenSet:
    """The authorization code for tokens (PKCE verifier, the resource indicator)."""
    return await _token_request(http, info, client, {
        "grant_type": "authorization_code", "code": code, "redirect_uri": redirect_url,
        "code_verifier": verifier}, asked)


async def refresh(http: OAuthHttp, info: ServerInfo, client: Client, token: str,
                  scopes: tuple[str, ...]) -> TokenSet:
    """New tokens for a refresh token (a server that rotates it answers a new one; the
    old one is kept where it answers none)."""
    got = await _token_request(http, info, client, {"grant_type": "refresh_token",
                                                     "refresh_token": token}, scopes)
    return got if got.refresh else TokenSet(got.access, token, got.expires_at, got.scopes)


async def revoke(http: OAuthHttp, info: ServerInfo, client: Client, token: str,
                 hint: str) -> bool:
    """Ask the server to revoke `token` (RFC 7009); False where it has no endpoint or
    did not take it (the gateway forgets the grant either way)."""
    if info.revocation_endpoint is None:
        return False
    form = {"token": token, "token_type_hint": hint, "client_id": client.client_id}
    if client.secret is not None:
        form["client_secret"] = client.secret
    try:
        status, _ = await http.post(info.revocation_endpoint, urlencode(form).encode(),
                                    "application/x-www-form-urlencoded")
    except OAuthError:
        return False
    return status == 200


def _error(answer: dict[str, Any]) -> str:
    """The OAuth error code of an answer, as a reason may show it (a code, not text)."""
    code = answer.get("error")
    if isinstance(code, str) and code.replace("_", "").isalnum() and len(code) <= 64:
        return f" ({code})"
    return ""
