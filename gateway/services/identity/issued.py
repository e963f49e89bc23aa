"""The tokens the admin listener issued, kept so they can be listed (the console's
sandboxes page, `GET /v1/tokens`): gateway tokens are stateless JWTs, so each one minted
(`POST /v1/tokens`, `token mint` in the CLI) or exchanged for a pod's
(`POST /v1/tokens/exchange`) has its claims recorded in the state store's records (kind
`token`, key its jti, gone when the token expires), shared by every process and replica
of the store. Never the token itself: a record names a token, it cannot be used as one.

Recording is best effort: a store that cannot be written (`StateUnavailable`) does not
fail the mint (the token is valid either way; only the list misses it); the failure is
logged and counted (`sandbox_gateway_state_store_errors_total{op="record_token"}`).
Tokens refreshed by a sandbox (`sandbox-gateway.internal`) are not recorded (that path
does no I/O); each belongs to the family of the token it was refreshed from, and
revoking that token's jti revokes the whole family.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Literal

from gateway.observability import metrics
from gateway.services.identity.tokens import MintedToken
from gateway.services.state.base import StateStore, StateUnavailable

__all__ = ["KIND", "Issued", "IssuedTokens"]

log = logging.getLogger("sandbox_gateway")

KIND = "token"
Via = Literal["mint", "exchange"]


@dataclass(frozen=True, slots=True)
class Issued:
    """What a record says of one issued token."""

    jti: str
    sandbox: str
    policy: str
    scope: str
    issued_at: float
    expires_at: float
    kind: str  # mint | exchange
    family: str = ""

    @classmethod
    def of(cls, minted: MintedToken, kind: Via) -> Issued:
        return cls(minted.jti, minted.sandbox, minted.policy, minted.scope, minted.issued_at,
                   minted.expires_at, kind, minted.family or minted.jti)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Issued:
        return cls(str(doc["jti"]), str(doc["sandbox"]), str(doc["policy"]),
                   str(doc.get("scope", "")), float(doc["issued_at"]),
                   float(doc["expires_at"]), str(doc.get("kind", "mint")),
                   str(doc.get("family") or doc["jti"]))

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)


class IssuedTokens:
    """Records issued tokens in the state store's records and lists the live ones."""

    def __init__(self, state: StateStore) -> None:
        self.state = state

    async def record(self, minted: MintedToken, kind: Via) -> bool:
        """Record `minted` (never raises for the store: False if it was not recorded)."""
        issued = Issued.of(minted, kind)
        try:
            await self.state.record_put(KIND, issued.jti, issued.to_doc(), issued.expires_at,
                                          None)
        except StateUnavailable as exc:
            metrics.STATE_STORE_ERRORS.labels(op="record_token").inc()
            log.warning("token %s (sandbox %s) was issued but not recorded, so it is not "
                        "listed: %s", issued.jti, issued.sandbox, exc)
            return False
        return True

    async def live(self) -> list[Issued]:
        """The recorded tokens that have not expired, newest first (raises
        StateUnavailable)."""
        found: list[Issued] = []
        for doc in await self.state.record_list(KIND):
            try:
                found.append(Issued.from_doc(doc))
            except (KeyError, TypeError, ValueError):
                continue  # (a record this version cannot read: not listed)
        return sorted(found, key=lambda t: (-t.issued_at, t.jti))

    def revoked(self, issued: Issued) -> bool:
        """Is the token revoked, or the family it belongs to? (The store's view, no I/O,
        as the gateway checks it.)"""
        return self.state.is_revoked(issued.jti) or self.state.is_revoked(issued.family)
