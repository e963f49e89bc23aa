"""The running gateway follows its signing-key directory, like the policy reloader.

`token rotate-key` (or an operator, or a Secret update) adds `<kid>.pem`; `token
retire-key` (or a deletion) removes one. Every `interval` the watcher takes a cheap
fingerprint of the directory (each `*.pem`'s name, resolved target, inode, mtime and
size, and the directory's resolved path, which catches Kubernetes `..data` swaps); when
it changes, the keys are loaded again in a worker thread and handed to
`TokenService.use_keys`: the newest key signs, every other one still verifies. A load
that fails (a half-copied file, no key left) is logged and counted, and the keys in use
stay: the gateway is never left unable to sign.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from gateway.observability.metrics import SIGNING_KEY_RELOADS
from gateway.services.identity.claims import TokenError
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.polling import Poller

__all__ = ["INTERVAL", "PICKUP_SECONDS", "SigningKeyWatcher", "key_fingerprint"]

log = logging.getLogger("gateway.tokens")

INTERVAL = 1.0
PICKUP_SECONDS = 2  # what `token rotate-key` promises: one poll plus the load

Fingerprint = tuple[tuple[str, ...], ...]


def key_fingerprint(directory: Path) -> Fingerprint:
    """A summary of the key directory that changes whenever a load could differ."""
    base = os.fspath(directory)
    try:
        names = sorted(n for n in os.listdir(base) if n.endswith(".pem"))
    except OSError as exc:
        return (("<error>", base, str(exc.errno)),)
    out: list[tuple[str, ...]] = [("<dir>", os.path.realpath(base))]
    for name in names:
        path = os.path.join(base, name)
        try:
            st = os.stat(path)
        except OSError as exc:
            out.append((name, "<error>", str(exc.errno)))
            continue
        out.append((name, os.path.realpath(path), str(st.st_ino), str(st.st_mtime_ns),
                    str(st.st_size)))
    return tuple(out)


class SigningKeyWatcher(Poller):
    """`load_now()` at start (creates a first key), then `start(on_change)` polls."""

    _poll_name = "signing-keys"

    def __init__(self, directory: Path, retired: Iterable[str] = (), *,
                 interval: float = INTERVAL) -> None:
        self.directory = directory
        self.retired = tuple(retired)
        self.interval = interval
        self._seen: Fingerprint | None = None
        self._on_change: Callable[[SigningKeys], None] | None = None

    def load_now(self) -> SigningKeys:
        """Load (creating a first key if there is none) and remember what was loaded."""
        keys = SigningKeys.load(self.directory, retired=self.retired)
        self._seen = key_fingerprint(self.directory)
        return keys

    async def check(self) -> bool:
        """Poll once; True when a new key set was handed over."""
        seen = key_fingerprint(self.directory)
        if seen == self._seen:
            return False
        self._seen = seen
        try:
            keys = await asyncio.to_thread(SigningKeys.load, self.directory, self.retired,
                                           False)
        except (TokenError, OSError) as exc:
            SIGNING_KEY_RELOADS.labels(result="error").inc()
            log.error("signing keys in %s not reloaded (%s); keeping the keys in use",
                      self.directory, exc)
            return False
        SIGNING_KEY_RELOADS.labels(result="ok").inc()
        log.info("signing keys reloaded from %s: signing with %s; verifying %s",
                 self.directory, keys.signing_kid, ", ".join(keys.active_kids()))
        if self._on_change is not None:
            self._on_change(keys)
        return True

    def start(self, on_change: Callable[[SigningKeys], None]) -> None:
        """Poll on the running loop; `on_change` gets every newly loaded set."""
        self._on_change = on_change
        self._poll()
