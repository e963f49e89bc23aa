"""A local fake of the Azure Key Vault REST API (and the Entra ID token endpoint) over TLS.

It listens on 127.0.0.1:<random port> in a background thread with its own
event loop, behind a certificate from a throwaway test CA whose SANs are
``*.vault.azure.net``, ``login.microsoftonline.com`` and 127.0.0.1. Clients
reach it by name through `LoopbackResolver` (so ``verify_challenge_resource``
sees real-looking vault host names) and trust it through `client_ssl_context`.

Behaviour copied from the real service:

- a request without a valid bearer token gets ``401`` with
  ``WWW-Authenticate: Bearer authorization="https://login.microsoftonline.com/<tenant>",
  resource="https://vault.azure.net"`` (the SDK's challenge flow);
- ``GET /secrets/{name}/?api-version=...`` and ``/secrets/{name}/{version}``
  return ``{"value", "id", "attributes", "tags"}``; a missing secret is a 404
  ``SecretNotFound`` error body; no ``api-version`` is a 400;
- ``POST /{tenant}/oauth2/v2.0/token`` accepts a client assertion (what
  ``WorkloadIdentityCredential`` sends) for one of ``scopes`` (Key Vault's by default;
  add Cognitive Services' for Azure OpenAI) and issues an access token valid for
  ``token_lifetime`` seconds; `issued(token, scope)` tells a fake API whether to
  accept a bearer token.

Programmable faults: ``outage`` ("503" or "drop" the connection), ``throttle``
(429 with Retry-After for the next N secret requests), per-name ``latency``,
``forbidden`` names (403 ForbiddenByRbac) and ``challenge_resource``.
Every request is recorded; `count` gives requests per secret name.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import secrets as pysecrets
import socket
import ssl
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

AUTHORITY_HOST = "login.microsoftonline.com"
VAULT_RESOURCE = "https://vault.azure.net"
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    429: "Too Many Requests",
    503: "Service Unavailable",
}


@dataclass
class Recorded:
    """One request the fake received."""

    method: str
    host: str
    path: str
    secret: str | None
    authorized: bool
    status: int  # 0 when the connection was dropped


@dataclass
class FakeKeyVault:
    """The fake server; use as a context manager or call `start` / `stop`."""

    workdir: Path
    tenant_id: str = "72f988bf-86f1-41af-91ab-2d7cd011db47"
    client_id: str = "00000000-0000-0000-0000-0000000000c1"
    #: The service-account token ``WorkloadIdentityCredential`` must present.
    federated_token: str = field(default_factory=lambda: "sa-token-" + pysecrets.token_hex(8))
    #: Extra bearer tokens accepted as valid (for static test credentials).
    static_tokens: set[str] = field(default_factory=set)
    challenge_resource: str = VAULT_RESOURCE
    scopes: set[str] = field(default_factory=lambda: {VAULT_RESOURCE + "/.default"})
    token_lifetime: int = 3599

    # Faults.
    outage: str | None = None  # None | "503" | "drop"
    retry_after: float = 1.0
    throttle: int = 0  # the next N secret requests get 429
    latency: dict[str, float] = field(default_factory=dict)
    forbidden: set[str] = field(default_factory=set)

    requests: list[Recorded] = field(default_factory=list)
    token_requests: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._secrets: dict[str, list[tuple[str, str]]] = {}  # name -> [(version, value)]
        self._issued: dict[str, tuple[str, float]] = {}  # token -> (scope, expiry)
        self._lock = threading.Lock()
        self.ca_path, cert_path, key_path = _make_certificates(self.workdir)
        self._server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._server_ctx.load_cert_chain(cert_path, key_path)
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.token_file = self.workdir / "sa-token"
        self.token_file.write_text(self.federated_token)

    # ----------------------------------------------------------- control
    def start(self) -> FakeKeyVault:
        """Start the server thread and wait until it listens."""
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            self._server = loop.run_until_complete(
                asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self._server_ctx)
            )
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name="fake-keyvault", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake Key Vault did not start")
        return self

    def stop(self) -> None:
        """Close every connection and stop the thread."""
        loop, server = self._loop, self._server
        if loop is None or server is None:
            return

        async def shutdown() -> None:
            server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            await server.wait_closed()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        assert self._thread is not None
        self._thread.join(10)
        self._loop = None

    def __enter__(self) -> FakeKeyVault:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------- data
    def set_secret(self, name: str, value: str) -> str:
        """Add a new version of ``name``; return its version id."""
        version = uuid.uuid4().hex
        with self._lock:
            self._secrets.setdefault(name, []).append((version, value))
        return version

    def delete_secret(self, name: str) -> None:
        with self._lock:
            self._secrets.pop(name, None)

    def count(self, secret: str, *, authorized: bool | None = None) -> int:
        """Requests received for ``secret`` (optionally only with/without a valid token)."""
        with self._lock:
            return sum(
                1
                for r in self.requests
                if r.secret == secret and (authorized is None or r.authorized == authorized)
            )

    def vault_url(self, name: str | None = None) -> str:
        """A real-looking vault URL (unique by default, so SDK challenge caches don't mix)."""
        return f"https://{name or 'kv' + uuid.uuid4().hex[:12]}.vault.azure.net"

    def client_ssl_context(self) -> ssl.SSLContext:
        """An SSL context that trusts only this fake's CA."""
        return ssl.create_default_context(cafile=str(self.ca_path))

    def resolver(self) -> LoopbackResolver:
        return LoopbackResolver(self.port)

    def issued(self, token: str, scope: str) -> bool:
        """True for a live token this fake issued for ``scope``."""
        with self._lock:
            found = self._issued.get(token)
        return found is not None and found[0] == scope and found[1] > time.time()

    def revoke(self, token: str) -> None:
        with self._lock:
            self._issued.pop(token, None)

    def issue_static_token(self) -> str:
        token = "static-" + pysecrets.token_hex(8)
        self.static_tokens.add(token)
        return token

    # ----------------------------------------------------------- HTTP
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                body = b""
                if int(headers.get("content-length", "0")):
                    body = await reader.readexactly(int(headers["content-length"]))
                reply = await self._handle(method, target, headers, body)
                if reply is None:  # simulated connection drop
                    writer.transport.abort()
                    return
                status, extra, payload = reply
                data = json.dumps(payload).encode() if payload is not None else b""
                out = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
                out += [f"{k}: {v}" for k, v in extra.items()]
                out += [
                    "Content-Type: application/json; charset=utf-8",
                    f"Content-Length: {len(data)}",
                    "x-ms-keyvault-service-version: 1.9.0.0",
                    "",
                    "",
                ]
                writer.write("\r\n".join(out).encode("latin-1") + data)
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, ssl.SSLError):
            return
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _handle(
        self, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], Any] | None:
        host = headers.get("host", "").split(":")[0].lower()
        url = urlsplit(target)
        query = parse_qs(url.query)
        if host == AUTHORITY_HOST:
            return self._token_endpoint(method, url.path, body)

        parts = [p for p in url.path.split("/") if p]
        secret = parts[1] if len(parts) >= 2 and parts[0] == "secrets" else None
        auth = headers.get("authorization", "")
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else ""
        with self._lock:
            authorized = token in self._issued or token in self.static_tokens

        def record(status: int) -> None:
            with self._lock:
                self.requests.append(Recorded(method, host, url.path, secret, authorized, status))

        if self.outage == "drop":
            record(0)
            return None
        if self.outage == "503":
            record(503)
            return (
                503,
                {"Retry-After": _num(self.retry_after)},
                _error("ServiceUnavailable", "The service is temporarily unavailable."),
            )
        if "api-version" not in query:
            record(400)
            return (
                400,
                {},
                _error("BadParameter", "The request URI contains an invalid API version."),
            )
        if not authorized:
            record(401)
            challenge = (
                f'Bearer authorization="https://{AUTHORITY_HOST}/{self.tenant_id}", '
                f'resource="{self.challenge_resource}"'
            )
            return (
                401,
                {"WWW-Authenticate": challenge},
                _error("Unauthorized", "AKV10000: Request is missing a Bearer or PoP token."),
            )
        if method != "GET" or secret is None or len(parts) > 3:
            record(405)
            return 405, {}, _error("BadParameter", "Method or path not supported by the fake.")
        delay = self.latency.get(secret, 0.0)
        if delay:
            await asyncio.sleep(delay)
        with self._lock:
            throttled = self.throttle > 0
            if throttled:
                self.throttle -= 1
        if throttled:
            record(429)
            return (
                429,
                {"Retry-After": _num(self.retry_after)},
                _error(
                    "Throttled",
                    "Request was not processed because too many requests were received.",
                ),
            )
        if secret in self.forbidden:
            record(403)
            return (
                403,
                {},
                {
                    "error": {
                        "code": "Forbidden",
                        "message": "Caller is not authorized to perform action on resource.\r\n"
                        "Action: 'Microsoft.KeyVault/vaults/secrets/getSecret/action'",
                        "innererror": {"code": "ForbiddenByRbac"},
                    }
                },
            )
        with self._lock:
            versions = list(self._secrets.get(secret, []))
        wanted = parts[2] if len(parts) == 3 else None
        found = [v for v in versions if wanted in (None, v[0])]
        if not found:
            record(404)
            what = f"{secret}/{wanted}" if wanted else secret
            return (
                404,
                {},
                _error(
                    "SecretNotFound",
                    f"A secret with (name/id) {what} was not found in this key vault. If you "
                    "recently deleted this secret you may be able to recover it using the correct "
                    "recovery command. For help resolving this issue, please see "
                    "https://go.microsoft.com/fwlink/?linkid=2125182",
                ),
            )
        version, value = found[-1]
        record(200)
        now = int(time.time())
        return (
            200,
            {},
            {
                "value": value,
                "id": f"https://{host}/secrets/{secret}/{version}",
                "attributes": {
                    "enabled": True,
                    "created": now,
                    "updated": now,
                    "recoveryLevel": "Recoverable+Purgeable",
                    "recoverableDays": 90,
                },
                "tags": {},
            },
        )

    def _token_endpoint(
        self, method: str, path: str, body: bytes
    ) -> tuple[int, dict[str, str], Any]:
        form = {k: v[0] for k, v in parse_qs(body.decode()).items()}
        with self._lock:
            self.token_requests.append({k: v for k, v in form.items() if k != "client_assertion"})
        if method != "POST" or path != f"/{self.tenant_id}/oauth2/v2.0/token":
            return 404, {}, {"error": "invalid_request", "error_description": "AADSTS90002"}
        if form.get("client_id") != self.client_id:
            return (
                400,
                {},
                {
                    "error": "unauthorized_client",
                    "error_description": "AADSTS700016: Application not found in the directory.",
                },
            )
        if form.get("client_assertion") != self.federated_token:
            return (
                400,
                {},
                {
                    "error": "invalid_client",
                    "error_description": (
                        "AADSTS700211: No matching federated identity record found."
                    ),
                },
            )
        if form.get("scope") not in self.scopes:
            return 400, {}, {"error": "invalid_scope", "error_description": "AADSTS70011"}
        token = "at-" + pysecrets.token_hex(16)
        with self._lock:
            self._issued[token] = (form["scope"], time.time() + self.token_lifetime)
        return (
            200,
            {},
            {
                "token_type": "Bearer",
                "expires_in": self.token_lifetime,
                "ext_expires_in": self.token_lifetime,
                "access_token": token,
            },
        )


class LoopbackResolver(AbstractResolver):
    """Resolves Key Vault and Entra ID names to the fake; refuses everything else.

    Port 443 is rewritten to the fake's port, so SDK URLs stay unchanged.
    """

    def __init__(self, port: int) -> None:
        self.port = port

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        host = host.lower().rstrip(".")
        if not (host.endswith(".vault.azure.net") or host == AUTHORITY_HOST):
            raise OSError(f"test resolver: {host} is not a faked name (no real DNS in tests)")
        return [
            {
                "hostname": host,
                "host": "127.0.0.1",
                "port": self.port,
                "family": socket.AF_INET,
                "proto": 0,
                "flags": socket.AI_NUMERICHOST,
            }
        ]

    async def close(self) -> None:
        return None


@asynccontextmanager
async def sdk_transport(fake: FakeKeyVault) -> AsyncIterator[Any]:
    """An ``AioHttpTransport`` whose session reaches the fake by name and trusts its CA."""
    from azure.core.pipeline.transport import AioHttpTransport

    connector = aiohttp.TCPConnector(resolver=fake.resolver(), ssl=fake.client_ssl_context())
    session = aiohttp.ClientSession(connector=connector)
    try:
        yield AioHttpTransport(session=session, session_owner=False)
    finally:
        await session.close()


class StaticCredential:
    """A minimal ``AsyncTokenCredential`` returning one bearer token."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.calls = 0

    async def get_token(self, *scopes: str, **kwargs: Any) -> Any:
        from azure.core.credentials import AccessToken

        self.calls += 1
        return AccessToken(self.token, int(time.time()) + 3600)

    async def close(self) -> None:
        return None

    async def __aenter__(self) -> StaticCredential:
        return self

    async def __aexit__(self, *args: object) -> None:
        return None


def _error(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _make_certificates(workdir: Path) -> tuple[Path, Path, Path]:
    """A test CA and a server certificate for the vault and login names."""
    workdir.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake keyvault test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "*.vault.azure.net")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("*.vault.azure.net"),
                    x509.DNSName(AUTHORITY_HOST),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_path = workdir / "fake-kv-ca.pem"
    cert_path = workdir / "fake-kv-server.pem"
    key_path = workdir / "fake-kv-server.key"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return ca_path, cert_path, key_path
