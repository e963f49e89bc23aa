"""Credential types whose value the gateway mints (pure data, like `presets`).

A policy credential ``{type: github-app, app_id: …, …}`` names a type from `TYPES`:
its fields (which are required, which name secrets in the store), the hosts it binds
to by default, where the sandbox puts its gateway token (the carriers) and where the
minted value goes. The loader validates a credential against its type; the minting
backends (``gateway/services/minting/``) read the parsed fields from `MintSpec`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from gateway.core.policy.injection import Injection

__all__ = ["MINTED_PREFIX", "TYPES", "Field", "MintSpec", "MintType", "Option", "cache_key"]

#: Cache names of minted values start with this (never a store secret's name).
MINTED_PREFIX = "minted:"

FieldKind = Literal["text", "secret", "url", "id", "texts", "mapping", "flag", "path",
                    "duration", "choice"]
Option = str | int | bool | tuple[str, ...] | tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a credential type. ``secret`` fields name a secret in the store;
    ``choice`` fields take one of ``choices``; ``default`` applies when absent."""

    name: str
    kind: FieldKind
    required: bool = False
    default: Option | None = None
    choices: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class MintType:
    """A credential type: its fields, default hosts, carriers and placement.

    ``carriers``: where the sandbox's gateway token may be (the first is the default).
    ``places``: where the minted value goes whatever carrier the client used (None:
    the same carrier). ``signs``: the value signs the request (SigV4) instead of
    being placed. ``challenge``: a request with no token gets ``401`` and
    ``WWW-Authenticate: Basic`` (git sends credentials only after a challenge).
    """

    name: str
    fields: tuple[Field, ...]
    hosts: tuple[str, ...]
    carriers: Injection
    places: Injection | None = None
    signs: bool = False
    challenge: bool = False

    def field(self, name: str) -> Field | None:
        return next((f for f in self.fields if f.name == name), None)


_BEARER = Injection("bearer")
_CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"


def _bearer(name: str, fields: tuple[Field, ...], hosts: tuple[str, ...] = ()) -> MintType:
    """A type whose gateway token comes as a bearer token and whose minted value goes
    there (no default hosts: the credential's rule names them)."""
    return MintType(name, fields, hosts, _BEARER, places=_BEARER)


def _oauth2(name: str, *fields: Field) -> MintType:
    """An OAuth 2.0 token-endpoint type: `token_url` and `client_id`, the grant's own
    `fields`, and how the client authenticates (HTTP Basic or in the form body)."""
    return _bearer(name, (Field("token_url", "url", required=True),
                          Field("client_id", "text", required=True), *fields,
                          Field("client_auth", "choice", default="basic",
                                choices=("basic", "body"))))

TYPES: dict[str, MintType] = {
    "github-app": MintType(
        "github-app",
        (Field("app_id", "id", required=True), Field("installation_id", "id", required=True),
         Field("private_key", "secret", required=True),
         Field("api_url", "url", default="https://api.github.com"),
         Field("permissions", "mapping"), Field("repositories", "texts")),
        ("github.com", "api.github.com"),
        Injection("basic", "x-access-token", alternatives=(_BEARER, Injection("token"))),
        challenge=True,
    ),
    "azure-entra": MintType(
        "azure-entra",
        (Field("scope", "text", default="https://cognitiveservices.azure.com/.default"),
         Field("credential", "choice", default="default",
               choices=("default", "workload", "managed")),
         Field("client_id", "text"), Field("tenant_id", "text"),
         Field("authority", "text"), Field("token_file", "path")),
        ("*.openai.azure.com", "*.cognitiveservices.azure.com"),
        Injection("header", "api-key", alternatives=(_BEARER,)),
        places=_BEARER,
    ),
    "aws-sigv4": MintType(
        "aws-sigv4",
        (Field("service", "text", required=True), Field("region", "text", required=True),
         Field("access_key_id", "secret"), Field("secret_access_key", "secret"),
         Field("role_arn", "text"), Field("session_name", "text", default="sandbox-gateway"),
         Field("external_id", "text"), Field("duration", "duration", default=3600),
         Field("web_identity", "flag", default=False), Field("token_file", "path"),
         Field("sts_url", "url")),
        (),  # from service and region: see `aws_hosts`
        Injection("header", "x-amz-security-token"),
        signs=True,
    ),
    "gcp-service-account": _bearer(
        "gcp-service-account",
        (Field("key", "secret"), Field("workload_identity", "flag", default=False),
         Field("scopes", "texts", default=(_CLOUD_PLATFORM,)), Field("token_url", "url")),
        ("aiplatform.googleapis.com", "*-aiplatform.googleapis.com"),
    ),
    "oauth2-client-credentials": _oauth2(
        "oauth2-client-credentials",
        Field("client_secret", "secret", required=True), Field("scope", "text"),
        Field("audience", "text"),
    ),
    "oauth2-refresh-token": _oauth2(
        "oauth2-refresh-token",
        Field("refresh_token", "secret", required=True), Field("client_secret", "secret"),
        Field("scope", "text"),
    ),
}


def aws_hosts(service: str, region: str) -> tuple[str, ...]:
    """Default hosts of an aws-sigv4 credential: the regional endpoint of the service
    (Bedrock: its runtime and agent-runtime endpoints too)."""
    if service == "bedrock":
        return tuple(f"{s}.{region}.amazonaws.com" for s in
                     ("bedrock-runtime", "bedrock", "bedrock-agent-runtime"))
    return (f"{service}.{region}.amazonaws.com",)


@dataclass(frozen=True, slots=True)
class MintSpec:
    """A minted credential's type and parsed fields (defaults filled in)."""

    type: str
    options: tuple[tuple[str, Option], ...]

    @classmethod
    def of(cls, type_: str, options: Mapping[str, Option]) -> MintSpec:
        return cls(type_, tuple(sorted(options.items())))

    def get(self, name: str) -> Option | None:
        return next((v for k, v in self.options if k == name), None)

    def text(self, name: str) -> str | None:
        value = self.get(name)
        return None if value is None else str(value)

    def texts(self, name: str) -> tuple[str, ...]:
        value = self.get(name)
        return tuple(str(v) for v in value) if isinstance(value, tuple) else ()

    def mapping(self, name: str) -> dict[str, str]:
        value = self.get(name)
        out: dict[str, str] = {}
        if isinstance(value, tuple):
            for item in value:
                if isinstance(item, tuple):
                    out[item[0]] = item[1]
        return out

    def flag(self, name: str) -> bool:
        return self.get(name) is True

    @property
    def secret_fields(self) -> tuple[tuple[str, str], ...]:
        """(field, secret name) of every field naming a store secret."""
        kind = TYPES[self.type]
        return tuple((k, str(v)) for k, v in self.options
                     if (f := kind.field(k)) is not None and f.kind == "secret")

    @property
    def secrets(self) -> tuple[str, ...]:
        """Names of the store secrets this credential reads (for `policy check`)."""
        return tuple(name for _, name in self.secret_fields)

    def fingerprint(self) -> str:
        """A short digest of the fields: a changed spec never reuses a minted value."""
        return hashlib.sha256(repr((self.type, self.options)).encode()).hexdigest()[:12]


def cache_key(name: str, spec: MintSpec) -> str:
    """The secret-cache name of credential ``name``'s minted value."""
    return f"{MINTED_PREFIX}{name}:{spec.fingerprint()}"
