"""The secret store contract and its errors.

A store maps a secret *name* (from a policy's ``credentials`` section) to a
`SecretValue`. Stores do no caching of their own: `SecretCache` owns caching,
single-flight, backoff and stale-if-error, so a store only has to fetch and to
classify failures. Error messages name the secret and the store, never a value,
and say what an operator should change.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from gateway.core.secret_value import SecretValue

# How the gateway signs in to Azure Key Vault (`secrets.credential`).
CREDENTIAL_KINDS: tuple[str, ...] = ("default", "workload", "managed")


class SecretError(Exception):
    """Base class of every secret-store error; its message is safe to show."""


class SecretNotFound(SecretError):
    """The store answered, and it has no secret by that name."""

    def __init__(self, secret_name: str, message: str | None = None) -> None:
        self.secret_name = secret_name
        super().__init__(message or f'secret "{secret_name}" was not found')

    @property
    def message(self) -> str:
        """The operator-facing explanation."""
        return str(self)


class SecretStoreError(SecretError):
    """The store could not answer.

    ``transient`` errors (throttling, 5xx, network) are worth retrying after a
    backoff; others (permissions, bad names, bad files) need an operator.
    ``retry_after`` carries the server's Retry-After in seconds, if any.
    """

    def __init__(
        self,
        message: str,
        status: int | None = None,
        retry_after: float | None = None,
        transient: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.transient = transient

    @property
    def message(self) -> str:
        """The operator-facing explanation."""
        return str(self)


class SecretStoreConfigError(SecretError, ValueError):
    """A store is misconfigured (bad path, unsafe permissions, missing settings).

    Raised at construction so the gateway refuses to start instead of failing
    on the first request.
    """


@runtime_checkable
class SecretStore(Protocol):
    """Where secret values come from (Key Vault, a local file, the environment)."""

    #: Store kind, used as the ``store`` metric label ("file", "env", "azure-keyvault").
    name: str

    async def fetch(self, secret_name: str) -> SecretValue:
        """Return the current value; raise `SecretNotFound` or `SecretStoreError`."""
        ...

    async def close(self) -> None:
        """Release connections and credentials."""
        ...
