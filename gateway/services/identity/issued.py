"""The tokens the admin listener issued, kept so they can be listed (the console's
sandboxes page, `GET /v1/tokens`): gateway tokens are stateless JWTs, so each one minted
(`POST /v1/tokens`, `token mint` in the CLI) or exchanged for a pod's
(`POST /v1/tokens/exchange`) has its claims recorded in the state store's records (kind
`token`, key its jti, gone when the token expires), shared by every process and replica
of the store. Never the token itself: a record names a token, it cannot be used as one.

A store that cannot be written (`StateUnavailable`) does not fail the mint (the token is
valid either way): the record is held in this process, listed by it meanwhile, and
written when the store is back (retried every second, `start`); the failure is logged
and counted (`sandbox_gateway_state_store_errors_total{op="record_token"}`). A record
held by a process that exits before the store is back is lost (the token is not
listed; it works as before).
Tokens refreshed by a sandbox (`sandbox-gateway.internal`) are not recorded (that path
does no I/O); each belongs to the family of the token it was refreshed from, and
revoking that token's jti revokes the whole family.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from gateway.observability import metrics
from gateway.services.identity.tokens import MintedToken
from gateway.services.polling import Poller
from gateway.services.state.base import StateStore, StateUnavailable

__all__ = ["KIND", "Issued", "IssuedTokens"]

log = logging.getLogger("sandbox_gateway")

KIND = "token"
Via = Literal["mint", "exchange"]
RETRY = 1.0  # seconds between attempts to write the records the store missed


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
    user: str | None = None  # the person named at mint (consent: user)

    @classmethod
    def of(cls, minted: MintedToken, kind: Via) -> Issued:
        return cls(minted.jti, minted.sandbox, minted.policy, minted.scope, minted.issued_at,
                   minted.expires_at, kind, minted.family or minted.jti, minted.user)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Issued:
        return cls(str(doc["jti"]), str(doc["sandbox"]), str(doc["policy"]),
                   str(doc.get("scope", "")), float(doc["issued_at"]),
                   float(doc["expires_at"]), str(doc.get("kind", "mint")),
                   str(doc.get("family") or doc["jti"]),
                   str(doc["user"]) if doc.get("user") else None)

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)


class IssuedTokens:
    """Records issued tokens in the state store's records and lists the live ones."""

    def __init__(self, state: StateStore, is_revoked: Callable[[str], bool] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.state = state
        # (the token service's revocations: this process's own and the store's view)
        self.is_revoked = is_revoked or state.is_revoked
        self.clock = clock
        self._held: dict[str, Issued] = {}  # jti -> record the store could not take yet
        self._retry = _Retry(self)

    @property
    def held(self) -> int:
        """Records waiting for the store."""
        return len(self._held)

    async def record(self, minted: MintedToken, kind: Via, *, hold: bool = True) -> bool:
        """Record `minted` (never raises for the store: False if it is not recorded yet,
        then held for later unless `hold` is False: a process that exits at once)."""
        issued = Issued.of(minted, kind)
        why = await self._put(issued)
        if why is None:
            return True
        metrics.STATE_STORE_ERRORS.labels(op="record_token").inc()
        if not hold:
            log.warning("token %s (sandbox %s) was issued but not recorded, so it is not "
                        "listed: %s", issued.jti, issued.sandbox, why)
            return False
        self._held[issued.jti] = issued
        log.warning("token %s (sandbox %s) was issued but not recorded yet: the record is "
                    "held here and written when the state store is back (%s)", issued.jti,
                    issued.sandbox, why)
        return False

    async def _put(self, issued: Issued) -> str | None:
        """Write one record; None when written (or recorded already), else why not."""
        try:
            await self.state.record_put(KIND, issued.jti, issued.to_doc(), issued.expires_at,
                                        None)
        except StateUnavailable as exc:
            return str(exc)
        return None

    async def write_held(self) -> int:
        """Write the held records (until the store refuses one); how many are still held."""
        now = self.clock()
        before = len(self._held)
        for jti, issued in list(self._held.items()):
            if issued.expires_at <= now:
                del self._held[jti]  # (no longer listed anyway)
            elif await self._put(issued) is None:
                del self._held[jti]
            else:
                break
        if before and not self._held:
            log.warning("the %d token record(s) held while the state store was away are "
                        "written to it", before)
        return len(self._held)

    async def live(self) -> list[Issued]:
        """The recorded tokens that have not expired, newest first, with those held here
        for the store (raises StateUnavailable)."""
        found: dict[str, Issued] = {}
        for doc in await self.state.record_list(KIND):
            try:
                issued = Issued.from_doc(doc)
            except (KeyError, TypeError, ValueError):
                continue  # (a record this version cannot read: not listed)
            found[issued.jti] = issued
        now = self.clock()
        for jti, issued in self._held.items():
            if issued.expires_at > now:
                found.setdefault(jti, issued)
        return sorted(found.values(), key=lambda t: (-t.issued_at, t.jti))

    def revoked(self, issued: Issued) -> bool:
        """Is the token revoked, or the family it belongs to? (As the gateway checks it:
        no I/O.)"""
        return self.is_revoked(issued.jti) or self.is_revoked(issued.family)

    def start(self) -> None:
        """Retry the held records every `RETRY` seconds until `stop`."""
        self._retry.start()

    async def stop(self) -> None:
        await self._retry.stop()
        if self._held and await self.write_held():
            log.warning("%d token record(s) were not written to the state store: those "
                        "tokens are not listed (they work until they expire)", len(self._held))


class _Retry(Poller):
    interval = RETRY
    _poll_name = "token-records"

    def __init__(self, issued: IssuedTokens) -> None:
        self.issued = issued

    async def check(self) -> bool:
        if not self.issued.held:
            return False
        before = self.issued.held
        return await self.issued.write_held() < before

    def start(self) -> None:
        self._poll()
