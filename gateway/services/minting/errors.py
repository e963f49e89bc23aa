"""What a mint raises: one error type that both the minters and their HTTP client use."""

from __future__ import annotations

from gateway.services.secrets.base import SecretStoreError

__all__ = ["MintFailed"]


class MintFailed(SecretStoreError):
    """A mint failed. The message is shown to operators and, in a 503 reason, to the
    sandbox: it is built from fixed sentences, names, status and error codes, never
    from secrets."""
