"""Secrets a provider minted for a sandbox through the gateway, and their aliases.

OpenAI's Realtime client secrets (``ek_...``), ChatKit sessions, Gemini's ephemeral
auth tokens and Azure OpenAI's Realtime sessions are minted with the real key and work
without it. On a rule with ``allow_minted_secrets: true`` the gateway relays the
provider's answer with an **alias** in place of each secret
(``gateway.services.metering.minted``) and keeps ``alias -> (secret, credential,
sandbox, expiry)`` here:

* the sandbox that minted it sends the alias back to the credential's own hosts, in a
  carrier of the key, and the gateway puts the secret in its place (metered like the
  key's call, on the same rule) — the secret itself never reaches the sandbox;
* the alias anywhere else is a leak marker, like a gateway token
  (``exfiltration_blocked``), and so is the secret off its credential's hosts;
* both are forgotten when the secret expires (the provider refuses it by then).

Pure bookkeeping, no I/O: the state store shares entries between the gateway's worker
processes and replicas (``add`` takes the share callback's result as is). An entry
without an alias (written by a gateway before aliases) is a leak marker only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from gateway.core.ephemeral import EphemeralKey, digest_of

__all__ = ["EphemeralKey", "EphemeralKeys"]

_MAX_KEYS = 100_000


class EphemeralKeys:
    """The keys every gateway process knows (see the module docstring). ``version``
    changes whenever the set does (the leak markers are rebuilt then)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._version = 0
        self._by_digest: dict[str, EphemeralKey] = {}
        self.share: Callable[[EphemeralKey], None] | None = None  # set by the state store
        self.on_change: Callable[[], None] | None = None  # (the log redaction's rebuild)
        self.before: Callable[[], None] | None = None  # brings the view up to date (a store)

    @property
    def version(self) -> int:
        """Changes whenever the set does (the leak markers are rebuilt then)."""
        if self.before is not None:
            self.before()
        return self._version

    def add(self, key: EphemeralKey, *, shared: bool = False) -> None:
        """Remember ``key``; ``shared``: it came from another process (not shared again)."""
        if key.expires_at <= self.clock():
            return
        digest = key.digest
        if digest in self._by_digest:
            return
        self._prune()
        if len(self._by_digest) >= _MAX_KEYS:  # bounded: the oldest expiry goes first
            oldest = min(self._by_digest.values(), key=lambda k: k.expires_at)
            del self._by_digest[oldest.digest]
        self._by_digest[digest] = key
        self._version += 1
        if self.on_change is not None:
            self.on_change()
        if not shared and self.share is not None:
            self.share(key)

    def extend(self, keys: Iterable[EphemeralKey]) -> None:
        """Keys another process shared (a store's snapshot)."""
        for key in keys:
            self.add(key, shared=True)

    def by_alias(self, alias: str) -> EphemeralKey | None:
        """The live key whose alias is ``alias``, if any (the secret itself finds
        nothing: the sandbox never holds it)."""
        if self.before is not None:
            self.before()
        key = self._by_digest.get(digest_of(alias))
        if key is None or key.alias is None or key.expires_at <= self.clock() or \
                not key.alias.equals(alias):
            return None
        return key

    def live(self) -> list[EphemeralKey]:
        """Every key not yet expired."""
        if self.before is not None:
            self.before()
        self._prune()
        return list(self._by_digest.values())

    def _prune(self) -> None:
        now = self.clock()
        expired = [d for d, k in self._by_digest.items() if k.expires_at <= now]
        for digest in expired:
            del self._by_digest[digest]
        if expired:
            self._version += 1
