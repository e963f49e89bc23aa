"""The signing key directory: `<kid>.pem` files (PKCS8 Ed25519), the newest one not
retired signing, every one not retired verifying (see `tokens.py`); keys are added
(`token rotate-key`) and retired (moved to `retired/`) here, each written aside and renamed
so a gateway following the directory (`keywatch.py`) never reads half a key."""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gateway.net.ca import write_private
from gateway.services.identity.claims import TokenError

__all__ = ["RETIRED_DIR", "SigningKeys"]

RETIRED_DIR = "retired"  # <signing dir>/retired/<kid>.pem: kept for the record, never loaded


@dataclass
class SigningKeys:
    """The signing key directory, loaded once."""

    directory: Path
    private: dict[str, Ed25519PrivateKey] = field(default_factory=dict)
    retired: frozenset[str] = frozenset()

    @classmethod
    def load(cls, directory: Path, retired: Iterable[str] = (), create: bool = True) -> SigningKeys:
        """Load every `<kid>.pem`; create a first key if the directory has none."""
        keys = cls(directory, retired=frozenset(retired))
        paths = sorted(directory.glob("*.pem")) if directory.is_dir() else []
        for path in paths:
            try:
                key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            except (OSError, ValueError, TypeError) as exc:
                raise TokenError(f"{path}: not a readable PEM private key ({exc})") from None
            if not isinstance(key, Ed25519PrivateKey):
                raise TokenError(f"{path}: not an Ed25519 private key")
            keys.private[path.stem] = key
        if not keys.active_kids():
            if not create:
                raise TokenError(f"no usable signing key in {directory}")
            keys.add_new()
        return keys

    def active_kids(self) -> list[str]:
        return sorted(k for k in self.private if k not in self.retired)

    @property
    def signing_kid(self) -> str:
        return self.active_kids()[-1]

    def add_new(self) -> str:
        """Generate a new key; it becomes the signing key (kids sort by creation time)."""
        # Microseconds, not random hex, after the second: keys made within one second
        # must still sort in creation order, or the older one would keep signing.
        now_us = time.time_ns() // 1000
        kid = ("k" + time.strftime("%Y%m%dT%H%M%S", time.gmtime(now_us // 1_000_000))
               + f"{now_us % 1_000_000:06d}")
        key = Ed25519PrivateKey.generate()
        # Written aside, then renamed: a gateway watching the directory never reads half a key.
        tmp = self.directory / f".{kid}.pem.tmp"
        write_private(tmp, key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ))
        os.replace(tmp, self.directory / f"{kid}.pem")
        self.private[kid] = key
        return kid

    def retire(self, kid: str) -> Path:
        """Move `<kid>.pem` to `retired/`: tokens it signed stop verifying (a running
        gateway notices within seconds). The signing key cannot be retired: rotate first."""
        if kid not in self.private:
            raise TokenError(f"no key {kid!r} in {self.directory}; "
                             f"keys: {', '.join(sorted(self.private)) or 'none'}")
        if kid == self.signing_kid:
            raise TokenError(f"{kid} is the signing key; run `token rotate-key` first, then "
                             "retire it")
        target = self.directory / RETIRED_DIR / f"{kid}.pem"
        target.parent.mkdir(mode=0o700, exist_ok=True)
        os.replace(self.directory / f"{kid}.pem", target)
        del self.private[kid]
        return target

    def public_keys(self) -> dict[str, Ed25519PublicKey]:
        return {kid: self.private[kid].public_key() for kid in self.active_kids()}

    def jwks(self) -> dict[str, Any]:
        """The public keys as a JWK Set (RFC 8037 OKP keys)."""
        out = []
        for kid, pub in self.public_keys().items():
            raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            x = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
            out.append({"kty": "OKP", "crv": "Ed25519", "x": x, "kid": kid,
                        "alg": "EdDSA", "use": "sig"})
        return {"keys": out}
