"""`github-app`: installation access tokens of a GitHub App.

The App's JWT (RS256 over the App's private key, `iss` = App id, issued 60 s in the
past against clock drift, valid 9 minutes: GitHub allows at most 10) is exchanged at
``POST {api_url}/app/installations/{id}/access_tokens`` for an installation token,
optionally narrowed to ``repositories`` and ``permissions``. The token lives until its
``expires_at`` (one hour), which becomes the value's lifetime.
"""

from __future__ import annotations

import datetime as dt
import json

import jwt

from gateway.core.policy.minted import MintSpec
from gateway.core.secret_value import MintedValue
from gateway.services.minting.base import MintContext, MintFailed, clean, read_secret

__all__ = ["GitHubAppMinter", "app_jwt"]

JWT_LIFETIME = 540  # seconds; GitHub refuses App JWTs valid for more than 10 minutes
JWT_BACKDATE = 60  # seconds; GitHub's advice against clock drift


def app_jwt(app_id: int, private_key: str, now: float) -> str:
    """The App's JWT (raises ValueError if the key is not an RSA private key)."""
    claims = {"iat": int(now) - JWT_BACKDATE, "exp": int(now) + JWT_LIFETIME,
              "iss": str(app_id)}
    try:
        return jwt.encode(claims, private_key, algorithm="RS256")
    except (jwt.InvalidKeyError, ValueError, TypeError) as exc:
        raise ValueError(type(exc).__name__) from None


class GitHubAppMinter:
    """Installation tokens for one App installation."""

    def __init__(self, spec: MintSpec, context: MintContext) -> None:
        self.spec = spec
        self.context = context
        self.app_id = int(str(spec.get("app_id")))
        self.installation = int(str(spec.get("installation_id")))
        self.api_url = spec.text("api_url") or "https://api.github.com"
        self.key_name = spec.text("private_key") or ""

    async def mint(self, fresh: bool) -> MintedValue:
        key = await read_secret(self.context.secrets, self.key_name, "GitHub App private key")
        try:
            token = app_jwt(self.app_id, key.reveal(), self.context.clock())
        except ValueError:
            raise MintFailed(f"secret {self.key_name!r} is not the GitHub App's RSA private "
                             "key in PEM (download it from the App's settings)") from None
        body: dict[str, object] = {}
        if self.spec.texts("repositories"):
            body["repositories"] = list(self.spec.texts("repositories"))
        if self.spec.mapping("permissions"):
            body["permissions"] = self.spec.mapping("permissions")
        url = f"{self.api_url}/app/installations/{self.installation}/access_tokens"
        reply = await self.context.http.request("POST", url, headers={
            "Authorization": f"Bearer {token}", "Accept": "application/vnd.github+json",
            "X-GitHub-Api-Version": "2022-11-28", "User-Agent": "sandbox-gateway",
            "Content-Type": "application/json"}, data=json.dumps(body).encode())
        if reply.status != 201:
            try:
                message = clean(reply.json().get("message", ""))
            except (ValueError, AttributeError):
                message = ""
            hint = {401: "; check app_id and the private key",
                    404: "; check installation_id (the App must be installed there)",
                    422: "; the requested repositories or permissions exceed the "
                         "installation's"}.get(reply.status, "")
            raise MintFailed(f"GitHub {self.api_url} answered {reply.status} for installation "
                             f"{self.installation} of App {self.app_id}"
                             f"{f' ({message})' if message else ''}{hint}",
                             status=reply.status, retry_after=reply.retry_after(),
                             transient=reply.status == 429 or reply.status >= 500)
        try:
            data = reply.json()
            value = str(data["token"])
            expires = dt.datetime.fromisoformat(str(data["expires_at"]).replace("Z", "+00:00"))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise MintFailed(f"GitHub {self.api_url} answered 201 without a token and its "
                             "expires_at") from None
        if not value:
            raise MintFailed(f"GitHub {self.api_url} answered an empty token")
        return MintedValue(value, lifetime=expires.timestamp() - self.context.clock())

    async def close(self) -> None:
        return None
