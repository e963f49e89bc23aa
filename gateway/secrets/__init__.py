"""Secret stores (Azure Key Vault, local file, environment) and the cache in front of them.

The request path only ever calls `SecretCache.get`; stores just fetch and
classify failures. Values travel as `SecretValue`, whose repr is masked.
`AzureKeyVaultStore` is imported on first use (the Azure SDK costs a process 10 MB).
"""

from typing import TYPE_CHECKING, Any

from gateway.secrets.base import (
    SecretError,
    SecretNotFound,
    SecretStore,
    SecretStoreConfigError,
    SecretStoreError,
)
from gateway.secrets.cache import SecretCache, SecretUnavailable
from gateway.secrets.env import EnvStore, env_var_name
from gateway.secrets.factory import (
    CacheOptions,
    build_cache,
    build_store,
    cache_options,
    parse_duration,
)
from gateway.secrets.file import FileStore
from gateway.secrets.value import SecretValue

if TYPE_CHECKING:
    from gateway.secrets.azure import AzureKeyVaultStore


def __getattr__(name: str) -> Any:
    if name == "AzureKeyVaultStore":
        from gateway.secrets.azure import AzureKeyVaultStore

        return AzureKeyVaultStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "AzureKeyVaultStore",
    "CacheOptions",
    "EnvStore",
    "FileStore",
    "SecretCache",
    "SecretError",
    "SecretNotFound",
    "SecretStore",
    "SecretStoreConfigError",
    "SecretStoreError",
    "SecretUnavailable",
    "SecretValue",
    "build_cache",
    "build_store",
    "cache_options",
    "env_var_name",
    "parse_duration",
]
