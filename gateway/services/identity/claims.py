"""What a sandbox token says, read and checked: the credential scope, the network and
person bindings, and a token's claims decoded without verification (for `explain`
only). Pure functions of text, shared by minting, the CLI, the admin API and the
verifier (`tokens.py`)."""

from __future__ import annotations

import base64
import ipaddress
import json
import re
from collections.abc import Iterable
from typing import Any

from gateway.core.identity import Scope, Workload

__all__ = ["USER", "TokenError", "check_user", "format_scope", "parse_cidrs", "parse_scope",
           "read_user", "read_workload", "unverified_claims"]

USER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}")  # a token's `user` (`usr` claim)


class TokenError(ValueError):
    """A token request is invalid (minting side)."""


def parse_scope(text: str | Iterable[str] | None) -> dict[str, frozenset[str] | None]:
    """Parse `openai anthropic:/v1/messages` into {credential: paths or None}."""
    items = text.split() if isinstance(text, str) else [
        part for chunk in (text or ()) for part in chunk.split()
    ]
    scope: dict[str, frozenset[str] | None] = {}
    for item in items:
        name, _, path = item.partition(":")
        if not name:
            raise TokenError(f"scope item {item!r} has no credential name")
        if path and not path.startswith("/"):
            raise TokenError(f"scope item {item!r}: a path must start with /")
        if name in scope and scope[name] is None:
            continue
        if not path:
            scope[name] = None
        else:
            scope[name] = (scope.get(name) or frozenset()) | {path}
    return scope


def format_scope(scope: Scope) -> str:
    parts: list[str] = []
    for name, paths in sorted(scope.items()):
        parts.extend([name] if paths is None else [f"{name}:{p}" for p in sorted(paths)])
    return " ".join(parts)




def parse_cidrs(items: Iterable[str]) -> list[str]:
    """Canonical network texts for a token's `cidr` binding (TokenError if invalid)."""
    out: list[str] = []
    for item in items:
        for text in item.replace(",", " ").split():
            try:
                out.append(ipaddress.ip_network(text, strict=False).compressed)
            except ValueError:
                raise TokenError(
                    f"cidr {text!r} is not an IP network (e.g. 10.0.0.5/32)") from None
    return out


def check_user(user: str | None) -> str | None:
    """A token's `user` as given at mint (TokenError if it is not a person's name or
    address: letters, digits and ``. _ @ + -``, at most 128 characters)."""
    if user is None:
        return None
    if not USER.fullmatch(user):
        raise TokenError("user must be a person's name or address: letters, digits and "
                         "'.', '_', '@', '+', '-' (at most 128 characters)")
    return user



def read_user(claim: Any) -> str | None:
    """The `usr` claim (TypeError if present and not a name: the token is refused)."""
    if claim is None:
        return None
    if not isinstance(claim, str) or not USER.fullmatch(claim):
        raise TypeError("usr")
    return claim


def read_workload(claim: Any) -> Workload | None:
    """The `pod` claim (KeyError/TypeError if present and incomplete)."""
    if claim is None:
        return None
    return Workload(str(claim["namespace"]), str(claim["pod"]), str(claim["uid"]),
                    str(claim["service_account"]))


def unverified_claims(token: str) -> dict[str, Any]:
    """Decode claims without verifying (for `explain` output only, never for decisions)."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return {}
    return dict(claims) if isinstance(claims, dict) else {}
