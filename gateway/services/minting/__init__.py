"""Credentials the gateway mints: GitHub App tokens, Entra ID, AWS SigV4, Google, OAuth2.

One small module per type (`github`, `azure`, `aws` + `sigv4`, `google`, `oauth2`),
a common layer (`base`: the minter contract; `http`: the client for token endpoints;
`store`: minted values behind the secret cache, and the gate's port). The gate sees
only the port: `get`/`invalidate`/`known_items` like the secret cache, and `signer`
for SigV4. Policy syntax: `gateway/core/policy/minted.py`; docs: docs/credentials.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gateway.core.policy import PolicySet
from gateway.services.minting.base import MintContext, Minter, MintFailed
from gateway.services.minting.http import TokenHttp
from gateway.services.minting.store import Credentials, MintingStore, make_minter
from gateway.services.secrets.cache import SecretCache
from gateway.services.state.base import MemoryMints, MintShare

# botocore logs canonical requests (session token included) and STS answers (secret keys)
# at DEBUG: a gateway run with debug logging must not write them out.
logging.getLogger("botocore").setLevel(logging.INFO)

__all__ = ["Credentials", "MintContext", "MintFailed", "Minter", "MintingStore", "TokenHttp",
           "build_credentials", "make_minter"]


def build_credentials(stored: SecretCache, policies: Callable[[], PolicySet], *,
                      upstream_ca: Path | None = None,
                      overrides: Mapping[str, tuple[str, int]] | None = None,
                      timeout: float = 15.0, share: MintShare | None = None,
                      connector: Callable[..., Any] | None = None) -> Credentials:
    """The gate's secrets port: ``stored`` for store secrets, and a second cache with
    the same settings over the minting backends for minted values, shared through
    ``share`` (the state store: one mint per credential for all its processes)."""
    http = TokenHttp(upstream_ca=upstream_ca, overrides=overrides, timeout=timeout,
                     connector=connector)
    minting = MintingStore(policies, MintContext(http=http, secrets=stored,
                                                 share=share or MemoryMints()))
    minted = SecretCache(minting, ttl=stored.ttl, refresh_ahead=stored.refresh_ahead,
                         stale_for=stored.stale_for, backoff_base=stored.backoff_base,
                         backoff_max=stored.backoff_max, fetch_timeout=timeout + 15.0,
                         on_change=stored.on_change)
    minting.shared.due_after = minted.refresh_after
    minting.shared.lease = timeout + 5.0  # (a token call's timeout, and then some)
    return Credentials(stored, minted, minting, http)
