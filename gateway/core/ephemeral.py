"""A provider-minted secret as the gateway knows it (``services/secrets/ephemeral`` keeps
them, shared through the state store; ``pipeline/markers`` scans for them)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from gateway.core.secret_value import SecretValue

__all__ = ["EphemeralKey", "digest_of"]


@dataclass(frozen=True, slots=True)
class EphemeralKey:
    """A provider-minted secret: for which credential and sandbox, until when, and the
    alias the sandbox holds in its place (None: an entry from before aliases)."""

    credential: str
    sandbox: str
    value: SecretValue
    expires_at: float
    alias: SecretValue | None = None

    @property
    def digest(self) -> str:
        """A stable id that reveals neither value (sha-256 of the alias, hex; of the
        secret for an entry without one): the store's key, the alias's lookup."""
        return digest_of((self.alias or self.value).reveal())


def digest_of(value: str) -> str:
    """sha-256 of ``value`` (hex): how an alias or a secret is looked up, never kept."""
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()
