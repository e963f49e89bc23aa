"""The key that seals MCP OAuth tokens in the state store (AES-256-GCM): 32 random bytes in
a file of its own (`mcp_oauth.key_file`, default `<certs>/mcp-oauth-key`), created on the
first start the way the DLP salt is (written whole to a file of its own, then linked into
place, so workers starting together agree on one key). Every process of a store must
share the file (a copy on each replica): a record sealed with another key does not open,
and its grant is asked for again."""

from __future__ import annotations

import base64
import json
import secrets
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gateway.services.keyfile import random_file

__all__ = ["KEY_FILE", "Sealer", "ensure_key"]

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
