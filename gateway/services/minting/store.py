"""Minted values behind the secret cache, and the port the gate reads every value from.

`MintingStore` is a `SecretStore` whose names are the cache names of minted
credentials (``minted:<credential>:<fingerprint>``): a fetch finds the credential in
the current policies and asks its `Minter`. Put behind a `SecretCache`, every minted
value gets what store secrets get — single-flight (100 concurrent requests, one
mint), refresh ahead of expiry, stale-if-error (never past the value's own expiry),
backoff honouring Retry-After — and appears in `known_items()`, so the gate's leak
markers and echo redaction cover it. A changed credential spec has another name, so a
policy edit never serves a value minted for the old one. Mints go through the state
store (`SharedMinter`): every worker process of a host (every replica, with Redis)
uses one mint per credential, and a restart reuses a value still valid.

`Credentials` is the gate's `Secrets` and `Signers` port: store secrets from one
cache, minted values from the other; an upstream 401 invalidates the minted value and
marks its next mint fresh.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.core.policy import Credential, PolicySet
from gateway.core.policy.minted import MINTED_PREFIX, MintSpec
from gateway.core.ports import Signer
from gateway.core.secret_value import SecretValue
from gateway.observability import metrics
from gateway.services.minting.base import MintContext, Minter, MintFailed
from gateway.services.minting.shared import SharedMinter
from gateway.services.secrets.base import SecretError, SecretNotFound
from gateway.services.secrets.cache import SecretCache

if TYPE_CHECKING:
    from gateway.services.minting.http import TokenHttp

log = logging.getLogger("sandbox_gateway")

__all__ = ["Credentials", "MintingStore", "make_minter"]


def make_minter(spec: MintSpec, context: MintContext) -> Minter:
    """The minter of a credential type (imports each backend only when used)."""
    if spec.type == "github-app":
        from gateway.services.minting.github import GitHubAppMinter

        return GitHubAppMinter(spec, context)
    if spec.type == "azure-entra":
        from gateway.services.minting.azure import EntraMinter

        return EntraMinter(spec, context)
    if spec.type == "aws-sigv4":
        from gateway.services.minting.aws import AwsMinter

        return AwsMinter(spec, context)
    if spec.type == "gcp-service-account":
        from gateway.services.minting.google import GcpMinter

        return GcpMinter(spec, context)
    if spec.type in ("oauth2-client-credentials", "oauth2-refresh-token"):
        from gateway.services.minting.oauth2 import OAuth2Minter

        return OAuth2Minter(spec, context)
    raise MintFailed(f"no minter for credential type {spec.type!r}")


class MintingStore:
    """A store of minted values (see the module docstring)."""

    name = "minted"

    def __init__(self, policies: Callable[[], PolicySet], context: MintContext,
                 factory: Callable[[MintSpec, MintContext], Minter] = make_minter) -> None:
        self.policies = policies
        self.context = context
        self.factory = factory
        self._minters: dict[str, Minter] = {}
        self._rejected: dict[str, SecretValue | None] = {}
        # Shared through the context's store; `due_after` is set by `build_credentials`
        # to the minted values' cache's refresh time (until then every fetch mints).
        self.shared = SharedMinter(context.share, due_after=lambda lifetime: 0.0,
                                   clock=context.clock)

    def credential(self, secret_name: str) -> Credential | None:
        return next((c for c in self.policies().credentials.values()
                     if c.secret == secret_name and c.mint is not None), None)

    def rejected(self, secret_name: str, value: SecretValue | None = None) -> None:
        """The upstream refused `value` (the current one): the next is minted fresh,
        or another process's if it differs."""
        self._rejected[secret_name] = value

    async def fetch(self, secret_name: str) -> SecretValue:
        credential = self.credential(secret_name)
        if credential is None or credential.mint is None:
            raise SecretNotFound(secret_name, "the credential is no longer in the policies")
        spec = credential.mint
        minter = self._minters.get(secret_name)
        if minter is None:
            await self._prune()
            minter = self._minters[secret_name] = self.factory(spec, self.context)
        fresh = secret_name in self._rejected
        rejected = self._rejected.pop(secret_name, None)
        try:
            value = await self.shared.mint(secret_name, lambda: minter.mint(fresh), rejected)
        except SecretError as exc:
            metrics.child(metrics.CREDENTIAL_MINTS, spec.type, "error").inc()
            log.warning("credential %s (%s): mint failed: %s", credential.name, spec.type, exc)
            raise
        except Exception as exc:
            metrics.child(metrics.CREDENTIAL_MINTS, spec.type, "error").inc()
            log.warning("credential %s (%s): mint failed unexpectedly (%s)", credential.name,
                        spec.type, type(exc).__name__)
            raise MintFailed(f"minting failed unexpectedly ({type(exc).__name__})",
                             transient=True) from None
        metrics.child(metrics.CREDENTIAL_MINTS, spec.type, "ok").inc()
        return value

    async def _prune(self) -> None:
        """Close minters of credentials no longer in the policies."""
        live = {c.secret for c in self.policies().credentials.values()}
        for name in [n for n in self._minters if n not in live]:
            await self._minters.pop(name).close()

    async def close(self) -> None:
        for minter in self._minters.values():
            await minter.close()
        self._minters.clear()


class Credentials:
    """The gate's `Secrets` and `Signers` port (see the module docstring)."""

    def __init__(self, stored: SecretCache, minted: SecretCache, minting: MintingStore,
                 http: TokenHttp | None = None) -> None:
        self.stored = stored
        self.minted = minted
        self.minting = minting
        self.http = http

    def _cache(self, name: str) -> SecretCache:
        return self.minted if name.startswith(MINTED_PREFIX) else self.stored

    async def get(self, name: str) -> SecretValue:
        return await self._cache(name).get(name)

    def invalidate(self, name: str, rejected: SecretValue | None = None) -> None:
        if name.startswith(MINTED_PREFIX):
            current = {n: v for n, v in self.minted.known_items()}.get(name)
            if current is not None and (rejected is None or current == rejected):
                self.minting.rejected(name, current)
        self._cache(name).invalidate(name, rejected)

    def known_items(self) -> list[tuple[str, SecretValue]]:
        return self.stored.known_items() + self.minted.known_items()

    def signer(self, credential: Credential, value: SecretValue) -> Signer:
        from gateway.services.minting.sigv4 import SigV4Signer

        return SigV4Signer(credential, value)

    async def close(self) -> None:
        await self.minted.close()  # closes the minting store and its minters
        await self.stored.close()
        if self.http is not None:
            await self.http.close()
