"""`EnvStore`: secrets from environment variables.

``openai-api-key`` is read from ``SANDBOX_GATEWAY_SECRET_OPENAI_API_KEY``: the
name is upper-cased and ``-`` / ``.`` become ``_``. Useful with Kubernetes
``envFrom: secretRef`` and in CI. The environment is read on every fetch, so a
test (or a process that edits ``os.environ``) sees changes at once.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from gateway.core.secret_value import SecretValue
from gateway.services.secrets.base import SecretNotFound, SecretStoreError

PREFIX = "SANDBOX_GATEWAY_SECRET_"
_VALID_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def env_var_name(secret_name: str, prefix: str = PREFIX) -> str:
    """The environment variable that holds ``secret_name``."""
    return prefix + secret_name.upper().replace("-", "_").replace(".", "_")


class EnvStore:
    """Secrets read from ``SANDBOX_GATEWAY_SECRET_<NAME>`` variables."""

    name = "env"

    def __init__(self, environ: Mapping[str, str] | None = None, prefix: str = PREFIX) -> None:
        self._environ = environ
        self.prefix = prefix

    async def fetch(self, secret_name: str) -> SecretValue:
        """Return the value of the variable for ``secret_name``."""
        if not _VALID_NAME.fullmatch(secret_name):
            raise SecretStoreError(
                f'secret name "{secret_name}" cannot be mapped to an environment variable; '
                "use letters, digits, '-', '_' and '.'"
            )
        var = env_var_name(secret_name, self.prefix)
        environ = os.environ if self._environ is None else self._environ
        value = environ.get(var)
        if value is None:
            raise SecretNotFound(
                secret_name,
                f'secret "{secret_name}" is not in the env store; set the environment '
                f"variable {var} in the gateway's environment",
            )
        if not value:
            raise SecretStoreError(
                f'secret "{secret_name}": the environment variable {var} is set but empty'
            )
        return SecretValue(value)

    async def close(self) -> None:
        """Nothing to release."""
