"""The `Detectors` port (`core/ports.py`): every detector of the catalogue, built once per
process into one `Scanner` keyed with the deployment's fingerprint salt.

**The salt** is 32 random bytes in a file of its own (`dlp.salt_file`, default
`<certs>/dlp-salt`, created 0600 on first start, like the admin token). Not derived from
the token signing key: signing keys rotate (and are replaced on a compromise), and a
fingerprint must stay the same for the same secret across that, so an operator can
follow one leaked key through months of audit lines. Replicas that share the certs
directory (they share the CA already) share the salt, so their fingerprints agree. The
salt is never logged; a fingerprint is HMAC-SHA256 under it (`core/dlp/findings.py`).

**When the detectors are built**: `runtime/app.py` builds them at start when a policy has
`dlp:`, else here on first use (a policy reloaded with `dlp:`); a process whose policies
have no `dlp:` never imports detect-secrets. Its plugin modules `import requests` for
their `verify` (a call to the provider), which the gateway never makes: they are imported
with `requests` standing in (`_requests_on_demand`), 5 MiB less a worker (requests,
urllib3, charset_normalizer, idna: ~90 modules; measured 2026-11-29).
"""

from __future__ import annotations

import contextlib
import importlib
import secrets
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gateway.core.dlp.catalogue import DETECTORS
from gateway.core.dlp.scanner import Scanner
from gateway.services.keyfile import random_file

__all__ = ["SALT_BYTES", "SALT_FILE", "LazyDetectors", "ensure_salt", "for_tools"]

SALT_FILE = "dlp-salt"
SALT_BYTES = 32


def ensure_salt(path: Path) -> bytes:
    """The salt in `path`, created (0600) if there is none. Workers starting together
    agree on one and never read a half-written file: the salt is written whole to a file
    of its own, then linked into place (`os.link` fails if another got there first, and
    that one is read). Raises OSError, or ValueError for a file too short."""
    data = random_file(path, SALT_BYTES)
    if len(data) < 16:
        raise ValueError(f"{path} holds fewer than 16 bytes; delete it to have a new salt "
                         "made, or write 32 random bytes into it")
    return data


class LazyDetectors:
    """Builds the scanner on first `scanner()` (or `build()` at start); `limit` is the
    most decoded bytes of a held body."""

    def __init__(self, salt: bytes, limit: int) -> None:
        self._salt = salt
        self._limit = limit
        self._scanner: Scanner | None = None
        self._lock = threading.Lock()

    @property
    def built(self) -> bool:
        return self._scanner is not None

    def scanner(self) -> Scanner:
        found = self._scanner
        if found is None:
            with self._lock:
                if self._scanner is None:
                    with _requests_on_demand():  # (slow: only when needed)
                        from gateway.services.dlp import library
                    self._scanner = Scanner(library.build(DETECTORS), self._salt,
                                            limit=self._limit)
                found = self._scanner
        return found

    def build(self) -> None:
        self.scanner()


@contextlib.contextmanager
def _requests_on_demand() -> Iterator[None]:
    """While detect-secrets' plugins are imported, `requests` is a stand-in module that
    imports the real package at the first read of any other name than `Response` (which
    two plugins name in return annotations: a placeholder class) and hands that name on;
    afterwards the stand-in leaves `sys.modules`, so any other importer gets the real
    package. A plugin's `verify` (never called here) would still reach the real one."""
    if "requests" in sys.modules:  # (imported already: nothing to save)
        yield
        return
    stand_in = types.ModuleType("requests", "stand-in: the real package on first use")

    def attribute(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)  # (copy, pickle and inspect probe dunders)
        if sys.modules.get("requests") is stand_in:
            del sys.modules["requests"]
        return getattr(importlib.import_module("requests"), name)

    vars(stand_in).update(__getattr__=attribute, Response=type("Response", (), {}))
    sys.modules["requests"] = stand_in
    try:
        yield
    finally:
        if sys.modules.get("requests") is stand_in:
            del sys.modules["requests"]


_TOOLS: list[LazyDetectors] = []


def for_tools() -> LazyDetectors:
    """The detectors of the tools that decide without traffic (`policy explain`, `policy
    test`, the admin API's and the console's explain): one per process, built on first
    use, under a random salt (their verdicts show no fingerprint)."""
    if not _TOOLS:
        from gateway.core.metering import MODEL_BODY_LIMIT
        _TOOLS.append(LazyDetectors(secrets.token_bytes(SALT_BYTES), MODEL_BODY_LIMIT))
    return _TOOLS[0]
