"""Credential carriers: find the sandbox's token where the provider expects its key,
take it out, and put the real key in the same place.

A carrier is a header (`x-api-key`), `Authorization: Bearer`, `Authorization: Basic`
(the key as password) or a query parameter (`?key=`). Presets list the carriers a
provider accepts (Anthropic: `x-api-key` or Bearer); the key goes into the carrier
the client used, or the preset's primary one.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from mitmproxy import http

from gateway.policy import Injection
from gateway.secrets import SecretValue


@dataclass(frozen=True, slots=True)
class Carried:
    """A value found in one carrier of a request."""

    carrier: Injection
    value: str


def _authorization(request: http.Request, scheme: str) -> str | None:
    auth = request.headers.get("Authorization")
    if auth is None:
        return None
    got, _, param = auth.strip().partition(" ")
    return param.strip() if got.lower() == scheme and param.strip() else None


def find_carried(request: http.Request, injection: Injection) -> Carried | None:
    """The first carrier of `injection` that holds a value in `request`."""
    for carrier in injection.carriers:
        value: str | None = None
        if carrier.kind == "header":
            assert carrier.name is not None
            value = request.headers.get(carrier.name)
        elif carrier.kind == "bearer":
            value = _authorization(request, "bearer")
        elif carrier.kind == "query":
            assert carrier.name is not None
            value = request.query.get(carrier.name)
        elif carrier.kind == "basic":
            param = _authorization(request, "basic")
            if param is not None:
                try:
                    value = base64.b64decode(param, validate=True).decode().partition(":")[2]
                except (binascii.Error, UnicodeDecodeError):
                    value = None
        if value:
            return Carried(carrier, value.strip())
    return None


def clear_carriers(request: http.Request, injection: Injection) -> None:
    """Remove every carrier of `injection` from `request` (the token must not go on)."""
    for carrier in injection.carriers:
        if carrier.kind == "header":
            assert carrier.name is not None
            request.headers.pop(carrier.name, None)
        elif carrier.kind in ("bearer", "basic"):
            if _authorization(request, carrier.kind) is not None:
                request.headers.pop("Authorization", None)
        elif carrier.kind == "query":
            assert carrier.name is not None
            if carrier.name in request.query:
                del request.query[carrier.name]


def place(request: http.Request, carrier: Injection, secret: SecretValue) -> None:
    """Put the real key into `carrier`."""
    key = secret.reveal()
    if carrier.kind == "header":
        assert carrier.name is not None
        request.headers[carrier.name] = key
    elif carrier.kind == "bearer":
        request.headers["Authorization"] = f"Bearer {key}"
    elif carrier.kind == "basic":
        raw = f"{carrier.name or ''}:{key}".encode()
        request.headers["Authorization"] = "Basic " + base64.b64encode(raw).decode()
    elif carrier.kind == "query":
        assert carrier.name is not None
        request.query[carrier.name] = key
