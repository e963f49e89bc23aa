"""One mint per credential for every process sharing a state store.

Each worker process has its own secret cache; left alone, each would mint its own
GitHub App token, Entra token or AWS session for the same credential. `SharedMinter`
puts the state store (`gateway.services.state.base.MintShare`: the SQLite file of this host, or
Redis for replicas) in front of a minter:

- a value another process minted, still before its **due** time (when the secret cache
  that minted it refreshes it), is taken as it is, with the lifetime it has left;
- otherwise one process takes the credential's **lease** (`LEASE` seconds), mints,
  writes the value and gives the lease back; the others poll the store (every `POLL`)
  and take the value it wrote, or the lease once it lapses (a process that died
  mid-mint); no wait is longer than `LEASE` + `POLL`;
- a value rejected upstream (401) is never taken again: the process that saw the
  rejection mints anew unless another already wrote a different value;
- the store out of reach (disk full, Redis down): this process mints for itself, as it
  would alone (one more mint, never a refused request).

Values are written to the store as they are (the SQLite file is 0600; Redis is the
operators' own) and never logged.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable

from gateway.core.secret_value import MintedValue, SecretValue
from gateway.services.minting.base import MintFailed
from gateway.services.state.base import MintShare, SharedMint, StateUnavailable

__all__ = ["LEASE", "POLL", "SharedMinter"]

log = logging.getLogger("sandbox_gateway")

LEASE = 20.0  # seconds one process may hold a credential's mint (the token call's timeout + 5)
POLL = 0.05  # seconds between looks at the store while another process mints


class SharedMinter:
    """Mints through a `MintShare` (see the module docstring). ``due_after(lifetime)``:
    seconds after a mint at which the secret cache refreshes a value of that lifetime."""

    def __init__(self, share: MintShare, due_after: Callable[[float | None], float],
                 clock: Callable[[], float] = time.time, lease: float = LEASE) -> None:
        self.share = share
        self.due_after = due_after
        self.clock = clock
        self.lease = lease
        self.holder = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._calls = itertools.count()
        self._down_logged = False

    async def mint(self, name: str, mint: Callable[[], Awaitable[MintedValue]],
                   rejected: SecretValue | None = None) -> MintedValue:
        """The value of `name`: another process's if usable, else minted here once."""
        deadline = time.monotonic() + self.lease + POLL
        holder = f"{self.holder}-{next(self._calls)}"  # (each call its own, even in a process)
        try:
            while True:
                found = self._usable(await self.share.read_mint(name), rejected)
                if found is not None:
                    return found
                if await self.share.lease_mint(name, holder, self.clock() + self.lease):
                    return await self._mint_leased(name, holder, mint, rejected)
                if time.monotonic() > deadline:
                    raise MintFailed(f"another gateway process held the mint of {name} for "
                                     f"more than {self.lease:g}s", transient=True)
                await asyncio.sleep(POLL)
        except StateUnavailable as exc:
            if not self._down_logged:
                self._down_logged = True
                log.warning("minted credentials: the state store is unavailable (%s): this "
                            "process mints for itself until it is back", exc)
            return await mint()

    async def _mint_leased(self, name: str, holder: str,
                           mint: Callable[[], Awaitable[MintedValue]],
                           rejected: SecretValue | None) -> MintedValue:
        try:
            # (another process may have written between the look and the lease)
            found = self._usable(await self.share.read_mint(name), rejected)
            if found is not None:
                return found
            minted_at = self.clock()
            value = await mint()
        except BaseException:
            await self.share.release_mint(name, holder)
            raise
        lifetime = value.lifetime
        record = SharedMint(value.reveal(), value.parts, minted_at,
                            None if lifetime is None else minted_at + lifetime,
                            minted_at + self.due_after(lifetime))
        await self.share.write_mint(name, record, holder)
        self._down_logged = False
        return value

    def _usable(self, found: SharedMint | None,
                rejected: SecretValue | None) -> MintedValue | None:
        if found is None:
            return None
        now = self.clock()
        if now >= found.due_at or (found.expires_at is not None and found.expires_at <= now):
            return None
        if rejected is not None and rejected.equals(found.value):
            return None
        lifetime = None if found.expires_at is None else found.expires_at - now
        return MintedValue(found.value, lifetime=lifetime, parts=found.parts)
