"""`oauth2-client-credentials` and `oauth2-refresh-token`: RFC 6749 token requests.

Client credentials (section 4.4) or a refresh token (section 6) are sent to
``token_url`` as a form; the client authenticates with HTTP Basic (default,
``client_auth: basic``, id and secret form-encoded first as section 2.3.1 says) or in
the body (``client_auth: body``). The answer's ``access_token`` is the value,
``expires_in`` its lifetime. A server that rotates refresh tokens returns a new one
(and retires the old): it is kept in the state store (`MintShare.write_refresh`), so
every worker process and the next start use it. It is kept with the digest of the
configured refresh token it descends from: when an operator puts a new refresh token
in the secret store, that one is used again.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from urllib.parse import quote_plus, urlencode

from gateway.core.policy.minted import MintSpec
from gateway.core.secret_value import MintedValue
from gateway.services.minting.base import MintContext, MintFailed, clean, read_secret
from gateway.services.state.base import StateUnavailable

log = logging.getLogger("sandbox_gateway")

__all__ = ["OAuth2Minter"]


class OAuth2Minter:
    """Access tokens from one OAuth2 token endpoint."""

    def __init__(self, spec: MintSpec, context: MintContext) -> None:
        self.spec = spec
        self.context = context
        self.refresh = spec.type == "oauth2-refresh-token"
        self.token_url = spec.text("token_url") or ""
        self.client_id = spec.text("client_id") or ""
        # Where the state store keeps the refresh token this client rotated to.
        self.refresh_key = f"oauth2:{self.token_url}:{self.client_id}:" \
            f"{spec.text('refresh_token') or ''}"
        self._kept: tuple[str, str] | None = None  # this process's copy (store unreachable)

    async def mint(self, fresh: bool) -> MintedValue:
        form = {"grant_type": "refresh_token" if self.refresh else "client_credentials"}
        for key in ("scope", "audience"):
            if self.spec.text(key):
                form[key] = self.spec.text(key) or ""
        origin = ""
        if self.refresh:
            name = self.spec.text("refresh_token") or ""
            configured = await read_secret(self.context.secrets, name, "refresh token")
            origin = hashlib.sha256(configured.reveal().encode()).hexdigest()
            try:
                kept = await self.context.share.read_refresh(self.refresh_key) or self._kept
            except StateUnavailable:
                kept = self._kept
            current = kept[1] if kept is not None and kept[0] == origin else \
                configured.reveal()
            form["refresh_token"] = current
        headers = {"Content-Type": "application/x-www-form-urlencoded",
                   "Accept": "application/json", "User-Agent": "sandbox-gateway"}
        secret_name = self.spec.text("client_secret")
        secret = None if secret_name is None else await read_secret(
            self.context.secrets, secret_name, "OAuth2 client secret")
        if secret is not None and self.spec.text("client_auth") != "body":
            pair = f"{quote_plus(self.client_id)}:{quote_plus(secret.reveal())}"
            headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        else:
            form["client_id"] = self.client_id
            if secret is not None:
                form["client_secret"] = secret.reveal()
        reply = await self.context.http.request("POST", self.token_url, headers=headers,
                                                data=urlencode(form).encode())
        try:
            data = reply.json()
        except ValueError:
            data = None
        if reply.status != 200 or not isinstance(data, dict):
            code = clean(data.get("error", ""), 64) if isinstance(data, dict) else ""
            raise MintFailed(f"the token endpoint {self.token_url} answered {reply.status}"
                             f"{f' ({code})' if code else ''} for client {self.client_id!r}",
                             status=reply.status, retry_after=reply.retry_after(),
                             transient=reply.status == 429 or reply.status >= 500)
        token = data.get("access_token")
        kind = str(data.get("token_type", "bearer")).lower()
        if not isinstance(token, str) or not token or kind != "bearer":
            raise MintFailed(f"the token endpoint {self.token_url} answered without a bearer "
                             "access_token")
        expires_in = data.get("expires_in")
        lifetime = float(expires_in) if isinstance(expires_in, int | float) and \
            not isinstance(expires_in, bool) and expires_in > 0 else None
        rotated = data.get("refresh_token")
        parts: tuple[str, ...] = ()
        if self.refresh and isinstance(rotated, str) and rotated:
            self._kept = (origin, rotated)
            try:
                await self.context.share.write_refresh(self.refresh_key, origin, rotated)
            except StateUnavailable as exc:
                log.warning("credential for client %r: the refresh token the server rotated "
                            "to is kept in this process only (%s)", self.client_id, exc)
            parts = (token, rotated)  # both are leak markers and redacted in responses
        return MintedValue(token, lifetime=lifetime, parts=parts)

    async def close(self) -> None:
        return None
