"""A local fake of GitHub over TLS: the App token exchange, a bit of the REST API, and
real git over HTTPS (`git http-backend` as CGI).

What it checks, like GitHub does:

- ``POST /app/installations/{id}/access_tokens`` (``api.github.com``) needs
  ``Authorization: Bearer <App JWT>``: an RS256 signature by the App's private key
  (verified with its public key), ``iss`` = the App id, ``iat``/``exp`` present,
  not expired, and valid for at most 10 minutes. It issues ``ghs_…`` installation
  tokens with ``expires_at`` (``token_lifetime`` seconds, one hour by default) and
  records the requested ``repositories``/``permissions``.
- The REST API (``GET /repos/{owner}/{repo}``, ``GET /installation/repositories``,
  ``GET /echo`` which echoes the Authorization header back) needs a live
  installation token as ``Bearer`` or ``token``; else 401 ``Bad credentials``.
- git (``github.com/{owner}/{repo}.git/...``) needs ``Basic x-access-token:<live
  token>``; else 401 with ``WWW-Authenticate: Basic``. Then ``git http-backend`` serves
  the bare repositories under ``root`` (push enabled: ``REMOTE_USER`` is set).

`revoke(token)` makes a token answer 401 (a re-mint test); `mints` counts exchanges.
"""

from __future__ import annotations

import base64
import datetime as dt
import os
import secrets as pysecrets
import subprocess
import time
from pathlib import Path

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from fakes.tlsserver import FakeServer, Reply, Request, json_reply

HOSTS = ["api.github.com", "github.com", "127.0.0.1"]


class FakeGitHub(FakeServer):
    def __init__(self, directory: Path, app_id: int = 4242, installation_id: int = 77,
                 token_lifetime: float = 3600.0) -> None:
        super().__init__(directory, HOSTS, "fake github")
        self.app_id = app_id
        self.installation_id = installation_id
        self.token_lifetime = token_lifetime
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.private_key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()).decode()
        self.public_key = key.public_key()
        self.tokens: dict[str, float] = {}  # token -> expiry (epoch)
        self.revoked: set[str] = set()
        self.mints: list[dict[str, object]] = []  # what each exchange asked for
        self.jwt_failures: list[str] = []
        self.root = directory / "repos"
        self.root.mkdir(parents=True, exist_ok=True)

    # -- control --------------------------------------------------------------------------

    def create_repo(self, owner: str, name: str, files: dict[str, str]) -> Path:
        """A bare repository with one commit holding `files`."""
        work = self.directory / f"work-{owner}-{name}"
        bare = self.root / owner / f"{name}.git"
        bare.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.test",
               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.test"}
        subprocess.run(["git", "init", "-q", "-b", "main", str(work)], check=True, env=env)
        for path, text in files.items():
            (work / path).write_text(text)
        subprocess.run(["git", "-C", str(work), "add", "."], check=True, env=env)
        subprocess.run(["git", "-C", str(work), "commit", "-q", "-m", "init"], check=True,
                       env=env)
        subprocess.run(["git", "clone", "-q", "--bare", str(work), str(bare)], check=True,
                       env=env)
        return bare

    def live(self, token: str) -> bool:
        with self.lock:
            expiry = self.tokens.get(token)
            return expiry is not None and expiry > time.time() and token not in self.revoked

    def revoke(self, token: str) -> None:
        with self.lock:
            self.revoked.add(token)

    @property
    def mint_count(self) -> int:
        with self.lock:
            return len(self.mints)

    # -- HTTP -----------------------------------------------------------------------------

    def handle(self, request: Request) -> Reply:
        if request.host == "github.com":
            return self._git(request)
        if request.method == "POST" and request.path == \
                f"/app/installations/{self.installation_id}/access_tokens":
            return self._exchange(request)
        if request.path.startswith("/app/installations/"):
            return json_reply(404, {"message": "Not Found"})
        token = _api_token(request.headers.get("authorization", ""))
        if token is None or not self.live(token):
            return json_reply(401, {"message": "Bad credentials",
                                    "documentation_url": "https://docs.github.com/rest"})
        if request.path == "/echo":
            return json_reply(200, {"authorization": request.headers.get("authorization")})
        if request.path == "/installation/repositories":
            names = sorted(p.name[:-4] for p in self.root.glob("*/*.git"))
            return json_reply(200, {"total_count": len(names),
                                    "repositories": [{"name": n} for n in names]})
        parts = request.path.strip("/").split("/")
        if len(parts) == 3 and parts[0] == "repos" and \
                (self.root / parts[1] / f"{parts[2]}.git").is_dir():
            return json_reply(200, {"full_name": f"{parts[1]}/{parts[2]}",
                                        "private": True, "default_branch": "main"})
        return json_reply(404, {"message": "Not Found"})

    def _exchange(self, request: Request) -> Reply:
        auth = request.headers.get("authorization", "")
        app_jwt = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
        try:
            claims = jwt.decode(app_jwt, self.public_key, algorithms=["RS256"],
                                options={"require": ["iat", "exp", "iss"]})
            if claims["iss"] != str(self.app_id):
                raise jwt.InvalidIssuerError("iss is not the App id")
            if int(claims["exp"]) - int(claims["iat"]) > 600 or \
                    int(claims["exp"]) > time.time() + 600:
                raise jwt.InvalidTokenError("'Expiration time' claim ('exp') is too far in "
                                            "the future")
        except jwt.PyJWTError as exc:
            with self.lock:
                self.jwt_failures.append(str(exc))
            return json_reply(401, {"message": "A JSON web token could not be decoded",
                                    "documentation_url": "https://docs.github.com/rest"})
        import json

        asked = json.loads(request.body or b"{}")
        token = "ghs_" + pysecrets.token_urlsafe(27)
        expiry = time.time() + self.token_lifetime
        with self.lock:
            self.tokens[token] = expiry
            self.mints.append(asked)
        expires_at = dt.datetime.fromtimestamp(expiry, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return json_reply(201, {"token": token, "expires_at": expires_at,
                                "permissions": asked.get("permissions") or {"contents": "write"},
                                "repository_selection": "selected"})

    def _git(self, request: Request) -> Reply:
        auth = request.headers.get("authorization", "")
        user, password = "", ""
        if auth.startswith("Basic "):
            user, _, password = base64.b64decode(auth[6:]).decode().partition(":")
        if user != "x-access-token" or not self.live(password):
            return Reply(401, b"Invalid username or token.\n",
                         {"WWW-Authenticate": 'Basic realm="GitHub"',
                          "Content-Type": "text/plain"})
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": str(self.root), "GIT_HTTP_EXPORT_ALL": "1",
            "PATH_INFO": request.path, "QUERY_STRING": request.target.partition("?")[2],
            "REQUEST_METHOD": request.method, "REMOTE_USER": "x-access-token",
            "REMOTE_ADDR": "127.0.0.1",
            "CONTENT_TYPE": request.headers.get("content-type", ""),
            "CONTENT_LENGTH": str(len(request.body)),
        }
        if "content-encoding" in request.headers:
            env["HTTP_CONTENT_ENCODING"] = request.headers["content-encoding"]
        if "git-protocol" in request.headers:
            env["GIT_PROTOCOL"] = request.headers["git-protocol"]
        out = subprocess.run(["git", "http-backend"], input=request.body, env=env,
                             capture_output=True, timeout=60)
        ends = [(i, sep) for sep in (b"\r\n\r\n", b"\n\n")
                if (i := out.stdout.find(sep)) >= 0]
        if not ends:
            return Reply(500, out.stderr[-500:], {"Content-Type": "text/plain"})
        at, sep = min(ends)
        head, body = out.stdout[:at], out.stdout[at + len(sep):]
        status, headers = 200, {}
        for line in head.decode("latin-1").splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.strip().split()[0])
            elif name:
                headers[name.strip()] = value.strip()
        return Reply(status, body, headers)


def _api_token(auth: str) -> str | None:
    scheme, _, value = auth.partition(" ")
    return value.strip() if scheme.lower() in ("bearer", "token") and value.strip() else None
