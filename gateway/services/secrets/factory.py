"""Build a `SecretStore` (and its `SecretCache`) from the ``secrets:`` config section.

::

    secrets: {store: file, path: ./secrets.local.yaml}
    secrets: {store: env}
    secrets: {store: azure-keyvault, vault_url: https://x.vault.azure.net,
              credential: workload, client_id: ..., verify_challenge_resource: true}
    secrets: {..., cache: {ttl: 5m, refresh_ahead: 1m, stale_for: 1h}}

Every mistake raises `ValueError` naming the key, e.g.
``secrets.vault_url: required for store azure-keyvault``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from gateway.services.secrets.base import CREDENTIAL_KINDS, SecretStore
from gateway.services.secrets.cache import SecretCache
from gateway.services.secrets.env import PREFIX, EnvStore
from gateway.services.secrets.file import FileStore

#: `secrets.credential` of the azure-keyvault store.

if TYPE_CHECKING:
    from azure.core.pipeline.transport import AsyncHttpTransport

DEFAULT_FILE = "./secrets.local.yaml"
STORES = ("file", "env", "azure-keyvault")
_COMMON_KEYS = {"store", "cache"}
_KEYS = {
    "file": {"path", "create_if_missing"},
    "env": {"prefix"},
    "azure-keyvault": {"vault_url", "credential", "client_id", "verify_challenge_resource"},
}
_CACHE_KEYS = ("ttl", "refresh_ahead", "stale_for", "backoff_base", "backoff_max")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h)?")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def build_store(
    config: Mapping[str, Any] | None,
    *,
    base_dir: str | os.PathLike[str] | None = None,
    transport: AsyncHttpTransport[Any, Any] | None = None,
) -> SecretStore:
    """Create the store the config describes (default: the local file store).

    ``base_dir`` anchors a relative ``path`` (the config file's directory).
    ``transport`` is handed to Key Vault for trust/resolution overrides.
    When ``path`` is not configured the default file is created (empty, 0600) if
    missing; an explicitly configured path must exist unless ``create_if_missing``.
    """
    config = {} if config is None else config
    if not isinstance(config, Mapping):
        raise ValueError(f"secrets: expected a mapping, got {type(config).__name__}")
    kind = config.get("store", "file")
    if kind not in STORES:
        raise ValueError(f"secrets.store: {kind!r} is not one of {', '.join(STORES)}")
    unknown = sorted(str(k) for k in set(config) - _COMMON_KEYS - _KEYS[kind])
    if unknown:
        raise ValueError(
            f"secrets.{unknown[0]}: unknown key for store {kind} "
            f"(allowed: {', '.join(sorted(_COMMON_KEYS | _KEYS[kind]))})"
        )
    if "cache" in config:
        cache_options(config)  # validate early

    if kind == "file":
        raw_path = config.get("path", DEFAULT_FILE)
        _require_str(raw_path, "path")
        create = config.get("create_if_missing", "path" not in config)
        _require_bool(create, "create_if_missing")
        path = Path(raw_path).expanduser()
        if base_dir is not None and not path.is_absolute():
            path = Path(base_dir) / path
        return FileStore(path, create_if_missing=create)

    if kind == "env":
        prefix = config.get("prefix", PREFIX)
        _require_str(prefix, "prefix")
        return EnvStore(prefix=prefix)

    vault_url = config.get("vault_url")
    if vault_url is None:
        raise ValueError("secrets.vault_url: required for store azure-keyvault")
    _require_str(vault_url, "vault_url")
    credential = config.get("credential", "default")
    if credential not in CREDENTIAL_KINDS:
        raise ValueError(
            f"secrets.credential: {credential!r} is not one of {', '.join(CREDENTIAL_KINDS)}"
        )
    client_id = config.get("client_id")
    if client_id is not None:
        _require_str(client_id, "client_id")
    verify = config.get("verify_challenge_resource", True)
    _require_bool(verify, "verify_challenge_resource")
    from gateway.services.secrets.azure import AzureKeyVaultStore  # (the Azure SDK: only when used)

    return AzureKeyVaultStore(
        vault_url,
        credential=credential,
        client_id=client_id,
        verify_challenge_resource=verify,
        transport=transport,
    )


class CacheOptions(TypedDict, total=False):
    """`SecretCache` keyword arguments that ``secrets.cache`` may set."""

    ttl: float
    refresh_ahead: float
    stale_for: float
    backoff_base: float
    backoff_max: float


def cache_options(config: Mapping[str, Any] | None) -> CacheOptions:
    """Parse ``secrets.cache`` (durations as seconds or "30s", "5m", "1h")."""
    section = (config or {}).get("cache") or {}
    if not isinstance(section, Mapping):
        raise ValueError("secrets.cache: expected a mapping")
    for key in section:
        if key not in _CACHE_KEYS:
            raise ValueError(
                f"secrets.cache.{key}: unknown key (allowed: {', '.join(_CACHE_KEYS)})"
            )
    options = CacheOptions()
    if "ttl" in section:
        options["ttl"] = parse_duration(section["ttl"], "secrets.cache.ttl")
    if "refresh_ahead" in section:
        options["refresh_ahead"] = parse_duration(
            section["refresh_ahead"], "secrets.cache.refresh_ahead"
        )
    if "stale_for" in section:
        options["stale_for"] = parse_duration(section["stale_for"], "secrets.cache.stale_for")
    if "backoff_base" in section:
        options["backoff_base"] = parse_duration(
            section["backoff_base"], "secrets.cache.backoff_base"
        )
    if "backoff_max" in section:
        options["backoff_max"] = parse_duration(section["backoff_max"], "secrets.cache.backoff_max")
    return options


def build_cache(store: SecretStore, config: Mapping[str, Any] | None) -> SecretCache:
    """A `SecretCache` over ``store`` with the ``secrets.cache`` settings."""
    try:
        return SecretCache(store, **cache_options(config))
    except ValueError as exc:
        message = str(exc)
        if not message.startswith("secrets."):
            message = f"secrets.cache: {message}"
        raise ValueError(message) from None


def parse_duration(raw: object, key: str) -> float:
    """Seconds from a number or a string like "500ms", "30s", "5m", "1h"."""
    if isinstance(raw, bool):
        raise ValueError(f"{key}: expected a duration such as 30s, 5m or 1h")
    if isinstance(raw, int | float):
        seconds = float(raw)
    elif isinstance(raw, str) and (m := _DURATION.fullmatch(raw.strip())):
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    else:
        raise ValueError(f"{key}: {raw!r} is not a duration such as 30s, 5m or 1h")
    if seconds < 0:
        raise ValueError(f"{key}: must not be negative")
    return seconds


def _require_str(value: object, key: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"secrets.{key}: expected a non-empty string, got {value!r}")


def _require_bool(value: object, key: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"secrets.{key}: expected true or false, got {value!r}")
