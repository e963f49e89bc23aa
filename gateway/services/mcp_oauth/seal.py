"""The key that seals MCP OAuth tokens in the state store (AES-256-GCM): 32 bytes from the
secret store (`mcp_oauth.key_secret`: base64 or hex, what `openssl rand -base64 32`
prints; every replica reads the same), or else in a file of its own
(`mcp_oauth.key_file`, default `<certs>/mcp-oauth-key`), created on the first start the
way the DLP salt is (written whole to a file of its own, then linked into place, so
workers starting together agree on one key). Every process of a store must use the same
key (a copy of the file on each replica): a record sealed with another key does not
open, and its grant is asked for again."""

from __future__ import annotations

import base64
import json
import secrets
import string
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gateway.services.keyfile import random_file

__all__ = ["KEY_FILE", "Sealer", "ensure_key", "key_from_secret"]

KEY_FILE = "mcp-oauth-key"
_KEY_BYTES = 32
_NONCE = 12


def ensure_key(path: Path) -> bytes:
    """The key in `path`, created (0600) if there is none. Raises OSError, or ValueError
    for a file that does not hold 32 bytes."""
    data = random_file(path, _KEY_BYTES)
    if len(data) != _KEY_BYTES:
        raise ValueError(f"{path} does not hold a {_KEY_BYTES}-byte key; delete it to have a "
                         "new one made (the grants sealed with it are then asked again)")
    return data


def key_from_secret(text: str) -> bytes:
    """The 32-byte key a secret holds as 64 hex digits or base64 (standard or URL-safe,
    padded or not). Raises ValueError (naming no byte of it) for anything else."""
    text = text.strip()
    if len(text) == 2 * _KEY_BYTES and all(c in string.hexdigits for c in text):
        return bytes.fromhex(text)
    try:
        key = base64.b64decode(text.replace("-", "+").replace("_", "/")
                               + "=" * (-len(text) % 4), validate=True)
    except ValueError:
        key = b""
    if len(key) != _KEY_BYTES:
        raise ValueError(f"the secret does not hold a {_KEY_BYTES}-byte key as base64 or "
                         "hex; make one with `openssl rand -base64 32`")
    return key


class Sealer:
    """Seals and opens JSON documents; `context` binds a sealed document to where it is
    kept (its record's kind and key), so one cannot be moved to another record."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def seal(self, doc: dict[str, Any], context: str) -> str:
        nonce = secrets.token_bytes(_NONCE)
        sealed = self._aead.encrypt(nonce, json.dumps(doc).encode(), context.encode())
        return base64.b64encode(nonce + sealed).decode()

    def open(self, text: str, context: str) -> dict[str, Any] | None:
        """The document, or None when it does not open (another key, another record)."""
        try:
            raw = base64.b64decode(text, validate=True)
            plain = self._aead.decrypt(raw[:_NONCE], raw[_NONCE:], context.encode())
            doc = json.loads(plain)
        except (InvalidTag, ValueError):
            return None
        return doc if isinstance(doc, dict) else None
