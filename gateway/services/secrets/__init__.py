"""Secret stores (Azure Key Vault, local file, environment) and the cache in front of them.

The request path only ever calls `SecretCache.get`; stores just fetch and
classify failures. Values travel as `SecretValue`, whose repr is masked.
The stores, the cache and the factory are imported on first use of one of their names
(`AzureKeyVaultStore`: the Azure SDK costs a process 10 MB; the cache needs asyncio, the
file store YAML), so the enforcement core, which needs only `SecretValue`, pulls in none.
"""

from typing import TYPE_CHECKING

from gateway.core.secret_value import SecretValue
from gateway.lazy import lazy_names
from gateway.services.secrets.base import (
    SecretError,
    SecretNotFound,
    SecretStore,
    SecretStoreConfigError,
    SecretStoreError,
)

if TYPE_CHECKING:
    from gateway.services.secrets.azure import AzureKeyVaultStore
    from gateway.services.secrets.cache import SecretCache, SecretUnavailable
    from gateway.services.secrets.env import EnvStore, env_var_name
    from gateway.services.secrets.factory import (
        CacheOptions,
        build_cache,
        build_store,
        cache_options,
        parse_duration,
    )
    from gateway.services.secrets.file import FileStore

__getattr__ = lazy_names(__name__, {
    "AzureKeyVaultStore": "azure", "SecretCache": "cache", "SecretUnavailable": "cache",
    "EnvStore": "env", "env_var_name": "env", "CacheOptions": "factory",
    "build_cache": "factory", "build_store": "factory", "cache_options": "factory",
    "parse_duration": "factory", "FileStore": "file"}, globals())

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
