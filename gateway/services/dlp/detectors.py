"""The `Detectors` port (`core/ports.py`): every detector of the catalogue, built once per
process into one `Scanner` keyed with the deployment's fingerprint salt.

**The salt** is 32 random bytes in a file of its own (`dlp.salt_file`, default
`<certs>/dlp-salt`, created 0600 on first start, like the admin token). Not derived from
the token signing key: signing keys rotate (and are replaced on a compromise), and a
fingerprint must stay the same for the same secret across that, so an operator can
follow one leaked key through months of audit lines. Replicas that share the certs
directory (they share the CA already) share the salt, so their fingerprints agree. The
salt is never logged; a fingerprint is HMAC-SHA256 under it (`core/dlp/findings.py`).

**When the detectors are built**: importing detect-secrets also imports `requests`
(about 0.2 s and 19 MiB). A process whose policies have no `dlp:` never pays it;
`runtime/app.py` builds them at start when a policy has `dlp:`, else here on first use
(a policy reloaded with `dlp:`).
"""

from __future__ import annotations

import secrets
import threading
from pathlib import Path

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
                    from gateway.services.dlp import library  # (slow: only when needed)
                    self._scanner = Scanner(library.build(DETECTORS), self._salt,
                                            limit=self._limit)
                found = self._scanner
        return found

    def build(self) -> None:
        self.scanner()


_TOOLS: list[LazyDetectors] = []


def for_tools() -> LazyDetectors:
    """The detectors of the tools that decide without traffic (`policy explain`, `policy
    test`, the admin API's and the console's explain): one per process, built on first
    use, under a random salt (their verdicts show no fingerprint)."""
    if not _TOOLS:
        from gateway.core.metering import MODEL_BODY_LIMIT
        _TOOLS.append(LazyDetectors(secrets.token_bytes(SALT_BYTES), MODEL_BODY_LIMIT))
    return _TOOLS[0]
