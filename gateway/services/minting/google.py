"""`gcp-service-account`: Google OAuth access tokens from google-auth.

From a service account's JSON key (``key`` names the secret holding it: google-auth
signs the JWT assertion and exchanges it at the key's ``token_uri``, or ``token_url``
if set) or from workload identity (``workload_identity: true``: Application Default
Credentials — the GKE metadata server, or a workload identity federation config in
``GOOGLE_APPLICATION_CREDENTIALS``), for ``scopes``. google-auth is synchronous: its
refresh runs in a worker thread, and its HTTP requests are handed back to the event
loop's `TokenHttp` (TLS roots, `network.resolve`, timeouts).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Mapping
from typing import Any

import google.auth
import google.auth.exceptions
import google.auth.transport
from google.oauth2 import service_account

from gateway.core.policy.minted import MintSpec
from gateway.core.secret_value import MintedValue
from gateway.services.minting.base import MintContext, MintFailed, clean, read_secret
from gateway.services.minting.http import TokenHttp

__all__ = ["GcpMinter", "LoopRequest"]


class _Response(google.auth.transport.Response):
    def __init__(self, status: int, headers: Mapping[str, str], data: bytes) -> None:
        self._status, self._headers, self._data = status, headers, data

    @property
    def status(self) -> int:
        return self._status

    @property
    def headers(self) -> Mapping[str, str]:
        return self._headers

    @property
    def data(self) -> bytes:
        return self._data


class LoopRequest(google.auth.transport.Request):
    """google-auth's transport interface, answered by `TokenHttp` on `loop` (called
    from a worker thread while the loop runs)."""

    def __init__(self, http: TokenHttp, loop: asyncio.AbstractEventLoop) -> None:
        self.http = http
        self.loop = loop

    def __call__(self, url: str, method: str = "GET", body: bytes | None = None,
                 headers: Mapping[str, str] | None = None, timeout: float | None = None,
                 **kwargs: Any) -> _Response:
        data = body.encode() if isinstance(body, str) else body
        future = asyncio.run_coroutine_threadsafe(
            self.http.request(method, url, headers=headers, data=data), self.loop)
        try:
            reply = future.result((timeout or self.http.timeout) + 5)
        except MintFailed as exc:
            raise google.auth.exceptions.TransportError(  # type: ignore[no-untyped-call]
                str(exc)) from None
        except TimeoutError:
            future.cancel()
            raise google.auth.exceptions.TransportError(  # type: ignore[no-untyped-call]
                f"{url} timed out") from None
        return _Response(reply.status, reply.headers, reply.body)


class GcpMinter:
    """Access tokens of one service account (key or workload identity)."""

    def __init__(self, spec: MintSpec, context: MintContext) -> None:
        self.spec = spec
        self.context = context
        self.scopes = list(spec.texts("scopes"))
        self._ambient: Any = None  # ADC credentials, made once

    def _from_key(self, text: str, name: str) -> Any:
        try:
            info = json.loads(text)
            if not isinstance(info, dict) or info.get("type") != "service_account":
                raise ValueError("not a service account key")
            token_url = self.spec.text("token_url")
            if token_url:
                info = {**info, "token_uri": token_url}
            return service_account.Credentials.from_service_account_info(  # type: ignore[no-untyped-call]
                info, scopes=self.scopes)
        except (ValueError, KeyError, TypeError):
            raise MintFailed(f"secret {name!r} is not a Google service account JSON key "
                             "(type: service_account, client_email, private_key, "
                             "token_uri)") from None

    async def mint(self, fresh: bool) -> MintedValue:
        name = self.spec.text("key")
        if name is not None:
            key = await read_secret(self.context.secrets, name, "service account key")
            credentials = self._from_key(key.reveal(), name)
        else:
            if self._ambient is None:
                try:
                    self._ambient, _ = await asyncio.to_thread(google.auth.default,
                                                               scopes=self.scopes)
                except google.auth.exceptions.DefaultCredentialsError as exc:
                    raise MintFailed("no Google workload identity (Application Default "
                                     f"Credentials): {clean(exc, 300)}") from None
            credentials = self._ambient
        request = LoopRequest(self.context.http, asyncio.get_running_loop())
        try:
            await asyncio.to_thread(credentials.refresh, request)
        except google.auth.exceptions.TransportError as exc:
            raise MintFailed(f"Google token request failed: {clean(exc, 300)}",
                             transient=True) from None
        except google.auth.exceptions.RefreshError as exc:
            detail = exc.args[0] if exc.args else type(exc).__name__
            raise MintFailed(f"Google refused a token: {clean(detail, 300)}") from None
        token = credentials.token
        if not isinstance(token, str) or not token:
            raise MintFailed("Google answered without an access token")
        expiry = credentials.expiry
        lifetime = None
        if isinstance(expiry, dt.datetime):
            aware = expiry.replace(tzinfo=dt.UTC) if expiry.tzinfo is None else expiry
            lifetime = aware.timestamp() - self.context.clock()
        return MintedValue(token, lifetime=lifetime)

    async def close(self) -> None:
        return None
