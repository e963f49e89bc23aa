"""Console sessions: the admin token, given once at sign-in, exchanged for a signed,
expiring cookie (HttpOnly, SameSite=Strict) and a CSRF token bound to it (pure).

Stateless: the cookie is `<payload>.<HMAC-SHA256>` under a key derived from the admin
token, so every worker (and replica sharing the token) accepts it, a new admin token
ends every session, and nothing of the token is in the cookie or any page.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable

__all__ = ["COOKIE", "LIFETIME", "Sessions"]

COOKIE = "sgw_console"
LIFETIME = 8 * 3600.0


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Sessions:
    """Makes and checks session cookies and their CSRF tokens."""

    def __init__(self, admin_token: str, clock: Callable[[], float] = time.time) -> None:
        self._admin = admin_token.encode()
        self._key = hashlib.sha256(b"sandbox-gateway console session\0" + self._admin).digest()
        self.clock = clock

    def token_ok(self, given: str) -> bool:
        """Is `given` the admin token (constant time)?"""
        return hmac.compare_digest(given.strip().encode(), self._admin)

    def new(self) -> str:
        """A fresh session cookie value."""
        payload = _b64(json.dumps({"exp": int(self.clock() + LIFETIME),
                                   "n": secrets.token_hex(16)}).encode())
        return f"{payload}.{self._sign(payload)}"

    def check(self, cookie: str | None) -> str | None:
        """The session's nonce if `cookie` is a valid, unexpired session; else None."""
        if not cookie or cookie.count(".") != 1:
            return None
        payload, mac = cookie.split(".")
        if not hmac.compare_digest(mac, self._sign(payload)):
            return None
        try:
            doc = json.loads(_unb64(payload))
            nonce, expires = str(doc["n"]), float(doc["exp"])
        except (ValueError, KeyError, TypeError):
            return None
        return nonce if expires > self.clock() else None

    def csrf(self, nonce: str) -> str:
        """The CSRF token of the session `nonce` (every form carries it)."""
        return self._sign("csrf:" + nonce)

    def csrf_ok(self, nonce: str, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given, self.csrf(nonce))

    def _sign(self, text: str) -> str:
        return _b64(hmac.new(self._key, text.encode(), hashlib.sha256).digest())
