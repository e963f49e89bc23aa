"""Console sessions: the admin token, given once at sign-in, exchanged for a session kept
in the state store and a cookie naming it (HttpOnly, SameSite=Strict), with a CSRF token
bound to it.

The cookie is `<session id>.<HMAC-SHA256>` under the console key, a key derived from the
admin token: a forged or foreign cookie is refused before the store is read. The store
keeps one record per session (kind `console_session`, keyed by a hash of the id, never
the id itself; gone when the session expires) that every worker and replica of the store
reads, so a session is revocable: signing out ends it on every process at once, "sign
out everywhere" ends them all, and a new admin token (a new console key) ends every
session, its records naming the key they were made under. A store that cannot answer
refuses sessions (fail closed): the console then says so rather than letting anyone in.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

from gateway.services.state.base import Records

__all__ = ["COOKIE", "KIND", "LIFETIME", "Sessions"]

COOKIE = "sgw_console"
KIND = "console_session"
LIFETIME = 8 * 3600.0
_ID = 32  # bytes of a session id


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class Sessions:
    """Makes, checks and ends console sessions (raise `StateUnavailable` when the store
    cannot answer)."""

    def __init__(self, admin_token: str, records: Records,
                 clock: Callable[[], float] = time.time) -> None:
        self._admin = admin_token.encode()
        self._key = hashlib.sha256(b"sandbox-gateway console session\0" + self._admin).digest()
        # (names the console key in each record: a record of another key is no session)
        self.key_id = _b64(hmac.new(self._key, b"key-id", hashlib.sha256).digest()[:12])
        self.records = records
        self.clock = clock

    def token_ok(self, given: str) -> bool:
        """Is `given` the admin token (constant time)?"""
        return hmac.compare_digest(given.strip().encode(), self._admin)

    async def new(self) -> str:
        """A fresh session, recorded; its cookie value."""
        session = _b64(secrets.token_bytes(_ID))
        now, key = self.clock(), self._record_key(session)
        doc = {"id": key, "key": self.key_id, "created": now, "expires": now + LIFETIME}
        if not await self.records.record_put(KIND, key, doc, now + LIFETIME, None):
            raise RuntimeError("a console session id was drawn twice")  # (never: 256 bits)
        return f"{session}.{self._sign(session)}"

    async def check(self, cookie: str | None) -> str | None:
        """The session's nonce (for its CSRF token) if `cookie` names a live session of
        this console key; else None."""
        session = self._verified(cookie)
        if session is None:
            return None
        found = await self.records.record_get(KIND, self._record_key(session))
        if found is None:
            return None
        doc = found[0]
        if doc.get("key") != self.key_id or doc.get("ended") or \
                not float(doc.get("expires", 0)) > self.clock():
            return None
        return self._record_key(session)

    async def end(self, cookie: str | None) -> bool:
        """End the session `cookie` names, on every process; True if one was live."""
        session = self._verified(cookie)
        return session is not None and await self._end(self._record_key(session))

    async def end_all(self) -> int:
        """End every session of the store (sign out everywhere); how many were live."""
        ended = 0
        for doc in await self.records.record_list(KIND):
            if isinstance(doc.get("id"), str) and not doc.get("ended"):
                ended += await self._end(doc["id"])
        return ended

    async def _end(self, key: str) -> bool:
        for _ in range(5):  # (compare-and-set: a concurrent end or sign-in elsewhere)
            found = await self.records.record_get(KIND, key)
            if found is None or found[0].get("ended"):
                return False
            doc, rev = found
            # expired now: gone from the store (a store that keeps it a moment, as Redis's
            # millisecond expiry does, still says it ended)
            if await self.records.record_put(KIND, key, {**doc, "ended": True},
                                             self.clock(), rev):
                return True
        return False

    def csrf(self, nonce: str) -> str:
        """The CSRF token of the session `nonce` (every form carries it)."""
        return self._sign("csrf:" + nonce)

    def csrf_ok(self, nonce: str, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given, self.csrf(nonce))

    def _verified(self, cookie: str | None) -> str | None:
        """The session id of a cookie signed with this console key, else None."""
        if not cookie or cookie.count(".") != 1 or len(cookie) > 200:
            return None
        session, mac = cookie.split(".")
        if not hmac.compare_digest(mac.encode(), self._sign(session).encode()):
            return None
        return session

    def _record_key(self, session: str) -> str:
        return _b64(hmac.new(self._key, b"record:" + session.encode(), hashlib.sha256).digest())

    def _sign(self, text: str) -> str:
        return _b64(hmac.new(self._key, text.encode(), hashlib.sha256).digest())
