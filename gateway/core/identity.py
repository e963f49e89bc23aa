"""Who a request comes from, as the core sees it: a verified token's claims (pure).

`gateway/services/identity/tokens.py` mints and verifies tokens (JWT, `signing_keys.py`, the
state store) and hands the core an `Identity`, or raises `TokenRefused`; the core needs
nothing more of it. Kept here so that the core imports no token machinery (cryptography, PyJWT).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Identity", "SandboxAddress", "Scope", "TokenRefused", "Workload"]


class TokenRefused(Exception):
    """A presented token is not acceptable. `code` is fixed; `reason` tells what to do.

    `identity`: the claims of a token whose signature verified and that is refused for
    time (expired, not yet valid), revocation or an unloaded policy, so that the
    refusal's audit line can name its sandbox, policy and jti. None for every token
    whose signature did not verify: unverified claims are never used.

    A plain exception, not a frozen dataclass: Python must be able to set
    `__traceback__` on it (contextlib does when it re-raises through a `with`).
    """

    def __init__(self, code: str, reason: str, identity: Identity | None = None) -> None:
        super().__init__(code, reason)
        self.code = code
        self.reason = reason
        self.identity = identity

    def __str__(self) -> str:
        return f"{self.code}: {self.reason}"


Scope = Mapping[str, frozenset[str] | None]
"""Credential name -> allowed path patterns (None: every path the policy allows)."""


@dataclass(frozen=True, slots=True)
class SandboxAddress:
    """A sandbox registered by source address (transparent mode)."""

    sandbox: str
    ip: str
    policy: str


@dataclass(frozen=True, slots=True)
class Workload:
    """The Kubernetes pod a sandbox is (identity.kubernetes): who it is by its address,
    or the pod an exchanged token is bound to (refused once that pod is gone)."""

    namespace: str
    pod: str
    uid: str
    service_account: str

    def fields(self) -> dict[str, str]:
        """The audit line's `workload` field."""
        return {"namespace": self.namespace, "pod": self.pod, "uid": self.uid,
                "service_account": self.service_account}


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a verified token says the sandbox is (or, `keyless`, who the pod holding the
    connection's source address is: then no token is carried anywhere, and credentials
    are injected without one in the provider's key slot)."""

    sandbox: str
    policy: str
    jti: str
    scope: Scope
    issued_at: float
    expires_at: float
    lifetime_end: float
    family: str = ""  # jti of the first token of a refresh chain (revoking it ends them all)
    cidr: tuple[str, ...] = ()  # source networks the token is bound to (empty: any)
    workload: Workload | None = None  # the pod it is, or its token is bound to
    keyless: bool = False  # identified by its address alone (a watched pod)
    user: str | None = None  # the person the operator named at mint (`consent: user`)

    def used_from(self, ip: str) -> bool:
        """Is a connection from `ip` allowed to use this token (its `cidr` binding)?"""
        if not self.cidr:
            return True
        try:
            addr = ipaddress.ip_address(ip.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return any(addr in ipaddress.ip_network(net) for net in self.cidr)

    def allows_credential(self, name: str, path: str) -> bool:
        """Is credential `name` in scope for request `path`? (prefix `**` patterns allowed)."""
        if name not in self.scope:
            return False
        paths = self.scope[name]
        if paths is None:
            return True
        bare = path.split("?", 1)[0]
        for pattern in paths:
            if pattern.endswith("/**"):
                if bare == pattern[:-3] or bare.startswith(pattern[:-2]):
                    return True
            elif bare == pattern:
                return True
        return False
