"""MCP OAuth grants, consent flows and registered clients in the state store's shared
records (`Records`), so every worker and replica uses one grant and a restart keeps it.
What is secret in them (access and refresh tokens, a PKCE verifier, a client secret) is
sealed (`seal.Sealer`, bound to the record's kind and key); the rest (who, which server,
which scopes, until when) stays readable for listing and audit.

    mcp_oauth_grant   <owner>|<resource>   one grant: tokens, scopes, the server's info
    mcp_oauth_flow    <state>              one consent waiting for its callback (single
                                           use: taken by compare-and-set)
    mcp_oauth_client  <issuer>|<redirect>  the client dynamic registration made
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gateway.core.audit import record
from gateway.services.mcp_oauth.seal import Sealer
from gateway.services.mcp_oauth.tokens import TokenSet
from gateway.services.state.base import Records

__all__ = ["CLIENT", "FLOW", "GRANT", "Grants", "Stored", "grant_line", "kept_until"]

GRANT, FLOW, CLIENT = "mcp_oauth_grant", "mcp_oauth_flow", "mcp_oauth_client"
KEEP = 90 * 86400.0  # a grant with a refresh token is kept this long unused
_TRIES = 5


@dataclass(frozen=True, slots=True)
class Stored:
    """A record as read: its readable `doc`, its opened `secret` part (None: it did not
    open) and its revision."""

    doc: dict[str, Any]
    secret: dict[str, Any] | None
    rev: int


class Grants:
    """Reads and writes the three kinds of records (see the module docstring)."""

    def __init__(self, store: Records, sealer: Sealer) -> None:
        self.store = store
        self.sealer = sealer

    async def get(self, kind: str, key: str) -> Stored | None:
        found = await self.store.record_get(kind, key)
        if found is None:
            return None
        doc, rev = found
        sealed = doc.get("sealed")
        secret = self.sealer.open(sealed, f"{kind}|{key}") if isinstance(sealed, str) else None
        return Stored({k: v for k, v in doc.items() if k != "sealed"}, secret, rev)

    async def put(self, kind: str, key: str, doc: dict[str, Any], secret: dict[str, Any],
                  expires_at: float, rev: int | None) -> bool:
        sealed = self.sealer.seal(secret, f"{kind}|{key}")
        return await self.store.record_put(kind, key, {**doc, "sealed": sealed}, expires_at,
                                           rev)

    async def take(self, kind: str, key: str, now: float) -> Stored | None:
        """Read and remove a record in one compare-and-set: exactly one caller gets it."""
        for _ in range(_TRIES):
            found = await self.get(kind, key)
            if found is None:
                return None
            raw = await self.store.record_get(kind, key)
            if raw is None or raw[1] != found.rev:
                continue
            if await self.store.record_put(kind, key, raw[0], now, found.rev):
                return found
        return None

    async def remove(self, kind: str, key: str, now: float) -> bool:
        return await self.take(kind, key, now) is not None

    async def grants(self) -> list[dict[str, Any]]:
        """Every grant's readable part (no secret)."""
        return [{k: v for k, v in d.items() if k != "sealed"}
                for d in await self.store.record_list(GRANT)]

    def version(self) -> int:
        return self.store.record_version(GRANT)


def kept_until(got: TokenSet, now: float) -> float:
    """Until when a grant's record is kept: `KEEP` with a refresh token, else a minute
    past its access token's expiry."""
    if got.refresh:
        return now + KEEP
    return (got.expires_at or now + KEEP) + 60


def grant_line(grant: dict[str, Any], decision: str, reason: str, now: float
               ) -> dict[str, Any]:
    """The audit line of a grant made (`grant`) or revoked (`revoke`): it names the grant
    (id, owner, server, scopes in `reason`), never a token."""
    parts = urlsplit(str(grant.get("server", "")))
    line = record(identity=None, client=None, listener="admin", method=None,
                  scheme="https", host=parts.hostname, port=parts.port or 443,
                  path=parts.path or "/", decision=decision, reason=reason,
                  rule=f"mcp_oauth:{grant.get('id')}", status=None, error=None,
                  bytes_in=None, bytes_out=None, started=now, path_taken=None,
                  engine="mcp_oauth", credential=f"mcp-oauth:{grant.get('id')}")
    line["sandbox"], line["policy"] = grant.get("sandbox"), grant.get("policy")
    return line
