"""Who a projected service-account token says it is: namespace, service account and
the pod it is bound to, verified by the API server (TokenReview) or offline against
the cluster's OIDC discovery (issuer, JWKS).

Both ways require the audience the gateway was configured with (a token the kubelet
projected for another audience, e.g. the API server's, is refused) and a binding to a
pod: an unbound token (`kubectl create token`) names no pod, and the exchange binds a
gateway token to one. TokenReview also checks that the service account and the pod
still exist; offline, the exchange checks the pod against the watched index either way.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import jwt

__all__ = ["AccountRefused", "Claims", "OidcVerifier", "TokenReviewVerifier"]

_TIMEOUT = aiohttp.ClientTimeout(total=10)
_ALGORITHMS = ["RS256", "RS384", "RS512", "ES256", "ES384", "ES512"]
_JWKS_REFRESH = 30.0  # at most one fetch of the keys this often (an unknown kid)


class AccountRefused(Exception):
    """The service-account token is not accepted; the message says why (no token text)."""


@dataclass(frozen=True, slots=True)
class Claims:
    """What a verified service-account token says."""

    namespace: str
    service_account: str
    pod: str
    pod_uid: str
    expires_at: float | None = None


async def _json(response: Any) -> Any:
    async with response:
        text = await response.text()
        if response.status >= 300:
            raise AccountRefused(f"the API server answered {response.status} "
                                 f"{_status_message(text)}")
    try:
        return json.loads(text)
    except ValueError:
        raise AccountRefused("the API server's answer is not JSON") from None


def _status_message(text: str) -> str:
    try:
        return str(json.loads(text).get("message") or "")[:200]
    except (ValueError, AttributeError):
        return ""


class TokenReviewVerifier:
    """Ask the API server (`authentication.k8s.io/v1` TokenReview, RBAC `create
    tokenreviews`): it checks signature, expiry, audience, and that the service account
    and the bound pod still exist as they were."""

    def __init__(self, api: Any, audience: str) -> None:
        self.api = api  # kubernetes_asyncio AuthenticationV1Api
        self.audience = audience

    async def verify(self, token: str) -> Claims:
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token, "audiences": [self.audience]}}
        try:
            response = await self.api.create_token_review(
                body, _preload_content=False, _request_timeout=_TIMEOUT)
            review = await _json(response)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise AccountRefused(f"cannot reach the API server for a TokenReview "
                                 f"({type(exc).__name__})") from None
        status = review.get("status") or {}
        if not status.get("authenticated"):
            error = str(status.get("error") or "not authenticated")[:200]
            raise AccountRefused(f"the API server did not authenticate the token: {error}")
        if self.audience not in (status.get("audiences") or [self.audience]):
            raise AccountRefused(f"the token is not for audience {self.audience!r}")
        user = status.get("user") or {}
        parts = str(user.get("username", "")).split(":")
        if len(parts) != 4 or parts[:2] != ["system", "serviceaccount"]:
            raise AccountRefused("the token is not a service account's")
        extra: Mapping[str, list[str]] = user.get("extra") or {}
        pod = (extra.get("authentication.kubernetes.io/pod-name") or [""])[0]
        pod_uid = (extra.get("authentication.kubernetes.io/pod-uid") or [""])[0]
        if not pod or not pod_uid:
            raise AccountRefused("the token is not bound to a pod; use the pod's projected "
                                 "service-account token (a serviceAccountToken volume)")
        return Claims(parts[2], parts[3], pod, pod_uid)


class OidcVerifier:
    """Verify offline: the signature against the cluster's JWKS (fetched from the API
    server, `/openid/v1/jwks`, refreshed for an unknown key), the issuer (`issuer`, or
    the discovery document's), audience, expiry and the `kubernetes.io` claims."""

    def __init__(self, well_known: Any, openid: Any, audience: str,
                 issuer: str | None = None, clock: Any = time.time) -> None:
        self.well_known = well_known  # kubernetes_asyncio WellKnownApi
        self.openid = openid  # kubernetes_asyncio OpenidApi
        self.audience = audience
        self.issuer = issuer
        self.clock = clock
        self._keys: dict[str, jwt.PyJWK] = {}
        self._fetched = float("-inf")

    async def _refresh(self) -> None:
        now = self.clock()
        if now - self._fetched < _JWKS_REFRESH:
            return
        self._fetched = now
        try:
            if self.issuer is None:
                discovery = await _json(await self.well_known.
                                        get_service_account_issuer_open_id_configuration(
                                            _preload_content=False,
                                            _request_timeout=_TIMEOUT))
                self.issuer = str(discovery.get("issuer") or "") or None
            keys = await _json(await self.openid.get_service_account_issuer_open_id_keyset(
                _preload_content=False, _request_timeout=_TIMEOUT))
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise AccountRefused(f"cannot fetch the cluster's signing keys "
                                 f"({type(exc).__name__})") from None
        found: dict[str, jwt.PyJWK] = {}
        for jwk in keys.get("keys") or ():
            try:
                key = jwt.PyJWK(jwk)
            except jwt.PyJWTError:
                continue
            if key.key_id:
                found[key.key_id] = key
        self._keys = found

    async def verify(self, token: str) -> Claims:
        try:
            kid = jwt.get_unverified_header(token).get("kid")
        except jwt.PyJWTError:
            raise AccountRefused("not a JWT") from None
        if not isinstance(kid, str) or kid not in self._keys:
            await self._refresh()
        key = self._keys.get(kid) if isinstance(kid, str) else None
        if key is None or self.issuer is None:
            raise AccountRefused("the token's signing key is not one of the cluster's")
        try:
            claims = jwt.decode(token, key=key, algorithms=_ALGORITHMS, audience=self.audience,
                                issuer=self.issuer,
                                options={"require": ["iss", "aud", "exp", "sub"]})
        except jwt.ExpiredSignatureError:
            raise AccountRefused("the token has expired") from None
        except jwt.InvalidAudienceError:
            raise AccountRefused(f"the token is not for audience {self.audience!r}") from None
        except jwt.InvalidIssuerError:
            raise AccountRefused("the token was issued by another issuer") from None
        except jwt.PyJWTError as exc:
            raise AccountRefused(f"the token does not verify ({type(exc).__name__})") from None
        k8s = claims.get("kubernetes.io") or {}
        account = (k8s.get("serviceaccount") or {}).get("name")
        pod = k8s.get("pod") or {}
        if not isinstance(k8s.get("namespace"), str) or not isinstance(account, str):
            raise AccountRefused("the token is not a service account's")
        if not pod.get("name") or not pod.get("uid"):
            raise AccountRefused("the token is not bound to a pod; use the pod's projected "
                                 "service-account token (a serviceAccountToken volume)")
        return Claims(k8s["namespace"], account, str(pod["name"]), str(pod["uid"]),
                      float(claims["exp"]))
