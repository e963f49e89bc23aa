"""What every minting backend shares: its contract, its failure, its inputs.

A `Minter` turns one credential's spec (`policy.minted.MintSpec`) into a
`MintedValue` — an access token with its lifetime, or an AWS key set. It reads the
secrets the spec names (a private key, a client secret) from the secret cache and
reaches token endpoints only through `TokenHttp`. Caching, single-flight, refresh
ahead, stale-if-error and backoff are not its business: `MintingStore` puts minters
behind a `SecretCache`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from gateway.core.secret_value import MintedValue, SecretValue
from gateway.services.minting.errors import MintFailed
from gateway.services.secrets.base import SecretError
from gateway.services.state.base import MemoryMints, MintShare

if TYPE_CHECKING:
    from gateway.services.minting.http import TokenHttp

__all__ = ["MintContext", "MintFailed", "Minter", "SecretSource", "clean", "read_secret"]


class SecretSource(Protocol):
    """Where minters read the secrets their credential names (the secret cache)."""

    async def get(self, name: str) -> SecretValue: ...


class Minter(Protocol):
    """Mints one credential's value. ``fresh``: the last value was rejected upstream
    (401), so library-side token caches are bypassed."""

    async def mint(self, fresh: bool) -> MintedValue: ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class MintContext:
    """What minters are given: the HTTP client, the secrets, a wall clock, and the
    share of the state store (minted values and rotated refresh tokens every process
    sees; one process's memory when none is given)."""

    http: TokenHttp
    secrets: SecretSource
    clock: Callable[[], float] = field(default=time.time)
    share: MintShare = field(default_factory=MemoryMints)


async def read_secret(source: SecretSource, name: str, what: str) -> SecretValue:
    """The value of secret ``name`` (``what`` it is for the message), or MintFailed."""
    try:
        return await source.get(name)
    except SecretError as exc:
        reason = getattr(exc, "reason", None) or str(exc)
        raise MintFailed(f"the {what} (secret {name!r}) is unavailable: {reason}",
                         transient=True) from None


_UNSAFE = re.compile(r"[^A-Za-z0-9 ._:/()'-]")


def clean(text: object, limit: int = 160) -> str:
    """An error code or message from a token endpoint, reduced to plain characters
    and bounded, for a reason."""
    return _UNSAFE.sub("", str(text))[:limit]
