"""A local fake of OAuth2 token endpoints and the APIs that take their tokens, over TLS.

- ``oauth2.googleapis.com/token``: Google's JWT-bearer grant. The assertion must be
  an RS256 JWT signed by the service account's key (verified with its public key,
  ``kid`` = the key id), ``iss`` = the account's email, ``aud`` = the token URI, a
  ``scope`` claim, ``iat``/``exp`` at most an hour apart. `service_account_info()` is
  the account's JSON key.
- ``login.example.test/oauth2/token``: RFC 6749 ``client_credentials`` (client
  authenticated by HTTP Basic, form-encoded id and secret, or in the body) and
  ``refresh_token`` (optionally rotating: each use returns a new refresh token and
  retires the old one).
- APIs: ``us-central1-aiplatform.googleapis.com`` (a Vertex ``generateContent``) takes
  Google tokens; ``api.internal.test`` (``/v1/items``, ``/v1/echo``) takes the
  OAuth2 server's. A missing, unknown, expired or revoked token gets 401.

Tokens live ``token_lifetime`` seconds; `grants` records each token issued.
"""

from __future__ import annotations

import base64
import secrets as pysecrets
import time
from pathlib import Path
from urllib.parse import unquote_plus

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from fakes.tlsserver import FakeServer, Reply, Request, json_reply

GOOGLE_TOKEN = "https://oauth2.googleapis.com/token"
VERTEX = "us-central1-aiplatform.googleapis.com"
INTERNAL = "api.internal.test"
LOGIN = "login.example.test"
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"


class FakeOAuth(FakeServer):
    def __init__(self, directory: Path, token_lifetime: int = 3600,
                 rotate_refresh_tokens: bool = False) -> None:
        super().__init__(directory, ["oauth2.googleapis.com", VERTEX, LOGIN, INTERNAL,
                                     f"refreshed.{INTERNAL}", "127.0.0.1"], "fake oauth")
        self.token_lifetime = token_lifetime
        self.rotate = rotate_refresh_tokens
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.sa_key_id = pysecrets.token_hex(20)
        self.sa_email = "agent@sandbox-project.iam.gserviceaccount.com"
        self.sa_pem = key.private_bytes(serialization.Encoding.PEM,
                                        serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()).decode()
        self.sa_public = key.public_key()
        self.client_id = "gateway-client"
        self.client_secret = "cs-" + pysecrets.token_urlsafe(18)
        self.refresh_token = "rt-" + pysecrets.token_urlsafe(18)
        self.tokens: dict[str, tuple[str, float]] = {}  # token -> (issuer kind, expiry)
        self.revoked: set[str] = set()
        self.grants: list[tuple[str, float, str]] = []  # (grant type, when, scope)
        self.failures: list[str] = []

    def service_account_info(self) -> dict[str, str]:
        return {"type": "service_account", "project_id": "sandbox-project",
                "private_key_id": self.sa_key_id, "private_key": self.sa_pem,
                "client_email": self.sa_email, "client_id": "1234567890",
                "token_uri": GOOGLE_TOKEN}

    def count(self, grant: str) -> int:
        with self.lock:
            return sum(1 for g, _, _ in self.grants if g == grant)

    def revoke(self, token: str) -> None:
        with self.lock:
            self.revoked.add(token)

    def live(self, token: str, kind: str) -> bool:
        with self.lock:
            found = self.tokens.get(token)
            return found is not None and found[0] == kind and found[1] > time.time() and \
                token not in self.revoked

    def _issue(self, kind: str, grant: str, scope: str) -> str:
        token = ("ya29." if kind == "google" else "at-") + pysecrets.token_urlsafe(24)
        with self.lock:
            self.tokens[token] = (kind, time.time() + self.token_lifetime)
            self.grants.append((grant, time.time(), scope))
        return token

    def _fail(self, status: int, error: str, why: str) -> Reply:
        with self.lock:
            self.failures.append(why)
        return json_reply(status, {"error": error, "error_description": why})

    # -- HTTP -----------------------------------------------------------------------------

    def handle(self, request: Request) -> Reply:
        if request.host == "oauth2.googleapis.com" and request.path == "/token":
            return self._google(request)
        if request.host == LOGIN and request.path == "/oauth2/token":
            return self._oauth(request)
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth.startswith("Bearer ") else ""
        if request.host == VERTEX and request.path.endswith(":generateContent"):
            if not self.live(token, "google"):
                return json_reply(401, {"error": {"code": 401, "status": "UNAUTHENTICATED",
                                                  "message": "Request had invalid "
                                                             "authentication credentials."}})
            return json_reply(200, {"candidates": [{"content": {
                "role": "model", "parts": [{"text": "Vertex says hi."}]},
                "finishReason": "STOP"}], "usageMetadata": {
                "promptTokenCount": 2, "candidatesTokenCount": 3, "totalTokenCount": 5}})
        if request.host.endswith(INTERNAL):
            if not self.live(token, "oauth"):
                return json_reply(401, {"error": "invalid_token"},
                                  {"WWW-Authenticate": 'Bearer error="invalid_token"'})
            if request.path == "/v1/echo":
                return json_reply(200, {"authorization": auth})
            return json_reply(200, {"items": ["a", "b"]})
        return json_reply(404, {"error": "not_found"})

    def _google(self, request: Request) -> Reply:
        form = request.form()
        if form.get("grant_type") != JWT_BEARER:
            return self._fail(400, "unsupported_grant_type", "need the JWT bearer grant")
        assertion = form.get("assertion", "")
        try:
            if jwt.get_unverified_header(assertion).get("kid") != self.sa_key_id:
                raise jwt.InvalidTokenError("kid is not the service account's key id")
            claims = jwt.decode(assertion, self.sa_public, algorithms=["RS256"],
                                audience=GOOGLE_TOKEN, issuer=self.sa_email,
                                options={"require": ["iat", "exp", "iss", "aud", "scope"]})
            if int(claims["exp"]) - int(claims["iat"]) > 3600:
                raise jwt.InvalidTokenError("assertion valid for more than an hour")
        except jwt.PyJWTError as exc:
            return self._fail(400, "invalid_grant", f"Invalid JWT: {exc}")
        token = self._issue("google", JWT_BEARER, str(claims["scope"]))
        return json_reply(200, {"access_token": token, "expires_in": self.token_lifetime,
                                "token_type": "Bearer"})

    def _oauth(self, request: Request) -> Reply:
        form = request.form()
        client_id, secret = form.get("client_id"), form.get("client_secret")
        auth = request.headers.get("authorization", "")
        if auth.startswith("Basic "):
            user, _, password = base64.b64decode(auth[6:]).decode().partition(":")
            client_id, secret = unquote_plus(user), unquote_plus(password)
        grant = form.get("grant_type", "")
        if client_id != self.client_id or ((grant == "client_credentials" or secret) and \
                secret != self.client_secret):
            return self._fail(401, "invalid_client", "client authentication failed")
        extra: dict[str, object] = {}
        if grant == "refresh_token":
            with self.lock:
                current = self.refresh_token
            if form.get("refresh_token") != current:
                return self._fail(400, "invalid_grant", "refresh token is invalid or retired")
            if self.rotate:
                with self.lock:
                    self.refresh_token = "rt-" + pysecrets.token_urlsafe(18)
                    extra["refresh_token"] = self.refresh_token
        elif grant != "client_credentials":
            return self._fail(400, "unsupported_grant_type", grant)
        token = self._issue("oauth", grant, form.get("scope", ""))
        return json_reply(200, {"access_token": token, "token_type": "Bearer",
                                "expires_in": self.token_lifetime, **extra})
