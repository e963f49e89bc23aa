"""Where an MCP server's tokens come from: its protected-resource metadata (RFC 9728),
found at the URL its 401 names (`WWW-Authenticate: Bearer resource_metadata=...`) or at
the well-known URIs beneath its origin, then its authorization server's metadata
(RFC 8414, else OpenID Connect discovery).

Checked as the MCP authorization specification asks: the metadata's `resource` is the
server the request is for, or an origin or path above it (a token is only asked for the
resource it will be sent to); the authorization server's `issuer` is the URL its
metadata was found from; it supports PKCE with S256 (else no code is asked for)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gateway.core.mcp_oauth import Challenge, audience_covers, resource_uri
from gateway.services.mcp_oauth.http import OAuthError, OAuthHttp

__all__ = ["ServerInfo", "discover"]


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What the gateway needs of a server to ask for, exchange and refresh its tokens."""

    resource: str  # as the metadata writes it: the `resource` indicator sent
    audience: str  # the same, canonical (`resource_uri`): what tokens are checked against
    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    registration_endpoint: str | None = None
    revocation_endpoint: str | None = None
    scopes_supported: tuple[str, ...] = ()  # the resource's (else its server's)
    server_scopes: tuple[str, ...] = ()  # every scope the authorization server names
    client_id_metadata: bool = False  # client ID metadata documents supported
    auth_methods: tuple[str, ...] = ("client_secret_basic",)

    def to_doc(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v)
                for k, v in ((f, getattr(self, f)) for f in self.__slots__)}

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> ServerInfo:
        fields: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v)
                                  for k, v in doc.items()}
        return cls(**fields)


def _canonical(url: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        return None
    return resource_uri("https", parts.hostname, parts.port or 443, parts.path or "/")


def _well_known(base: str, suffix: str) -> list[str]:
    """The well-known URIs of `base` (RFC 8615: inserted between host and path), the
    path-less one last."""
    parts = urlsplit(base)
    origin = f"https://{parts.netloc}"
    path = parts.path.rstrip("/")
    return [f"{origin}/.well-known/{suffix}{path}", f"{origin}/.well-known/{suffix}{path}/",
            f"{origin}/.well-known/{suffix}"] if path else [f"{origin}/.well-known/{suffix}"]


async def _resource_metadata(http: OAuthHttp, resource: str,
                             challenge: Challenge | None) -> dict[str, Any]:
    named = challenge.resource_metadata if challenge is not None else None
    for url in [named] if named else _well_known(resource, "oauth-protected-resource"):
        doc = await http.get_json(url)
        if doc is not None:
            return doc
    raise OAuthError(f"the MCP server {resource} publishes no protected-resource metadata "
                     "(RFC 9728)")


async def _server_metadata(http: OAuthHttp, issuer: str) -> dict[str, Any]:
    parts = urlsplit(issuer)
    origin, path = f"https://{parts.netloc}", parts.path.rstrip("/")
    urls = [f"{origin}/.well-known/oauth-authorization-server{path}",
            f"{origin}/.well-known/openid-configuration{path}"]
    if path:
        urls.append(f"{origin}{path}/.well-known/openid-configuration")
    for url in urls:
        doc = await http.get_json(url)
        if doc is not None:
            return doc
    raise OAuthError(f"the authorization server {issuer} publishes no metadata (RFC 8414 "
                     "or OpenID Connect discovery)")


def _text(doc: dict[str, Any], key: str, where: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not value.startswith("https://"):
        raise OAuthError(f"{where} names no https {key}")
    return value


def _texts(doc: dict[str, Any], key: str) -> tuple[str, ...]:
    value = doc.get(key)
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()


async def discover(http: OAuthHttp, resource: str, challenge: Challenge | None) -> ServerInfo:
    """The server's `ServerInfo` (raises OAuthError saying what is missing or wrong)."""
    prm = await _resource_metadata(http, resource, challenge)
    named = prm.get("resource")
    stated = _canonical(named) if isinstance(named, str) else None
    if stated is None or not audience_covers(stated, resource):
        raise OAuthError(f"the protected-resource metadata of {resource} names resource "
                         f"{str(named)[:200]!r}, not this server (a token is asked only for "
                         "the resource it is sent to)")
    servers = _texts(prm, "authorization_servers")
    if not servers or not servers[0].startswith("https://"):
        raise OAuthError(f"the protected-resource metadata of {resource} names no https "
                         "authorization server")
    issuer = servers[0]
    meta = await _server_metadata(http, issuer)
    if str(meta.get("issuer", "")).rstrip("/") != issuer.rstrip("/"):
        raise OAuthError(f"the metadata found for authorization server {issuer} names "
                         "another issuer (RFC 8414 3.3)")
    if "S256" not in _texts(meta, "code_challenge_methods_supported"):
        raise OAuthError(f"the authorization server {issuer} does not support PKCE with "
                         "S256")
    where = f"the metadata of authorization server {issuer}"
    optional = {k: _text(meta, k, where) for k in ("registration_endpoint",
                                                   "revocation_endpoint") if meta.get(k)}
    return ServerInfo(
        resource=str(named), audience=stated, issuer=issuer,
        authorization_endpoint=_text(meta, "authorization_endpoint", where),
        token_endpoint=_text(meta, "token_endpoint", where),
        registration_endpoint=optional.get("registration_endpoint"),
        revocation_endpoint=optional.get("revocation_endpoint"),
        scopes_supported=_texts(prm, "scopes_supported") or _texts(meta, "scopes_supported"),
        server_scopes=_texts(meta, "scopes_supported"),
        client_id_metadata=meta.get("client_id_metadata_document_supported") is True,
        auth_methods=_texts(meta, "token_endpoint_auth_methods_supported")
        or ("client_secret_basic",))
