"""Secret fetch and signing: the credential a rule names is put where the sandbox's
placeholder was (`core/credentials.plan`, `apply`), fetched from the secret store or
minted, or the request re-signed (AWS SigV4) with it; a provider-minted secret's alias
is swapped back for the secret on its credential's hosts only.

Nothing here decides whether a request may pass: that was decided before (stage 1 and
the leak scan of the head); a secret that cannot be had refuses the request
(`secret_unavailable`, `credential_unavailable`), never lets it go without.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.core import credentials
from gateway.core.credentials import Swap
from gateway.core.ports import Signer
from gateway.core.refusal import Refusal
from gateway.core.secret_value import SecretValue
from gateway.core.trail import rule_of
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.parts import Parts

__all__ = ["Signing"]


class Signing:
    """Puts the credential in an exchange (see the module docstring)."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts

    def minted_finder(self, credential: str, ex: Exchange
                      ) -> Callable[[str], SecretValue | None]:
        """Finds the provider-minted secret whose alias a carrier holds: minted with
        `credential` by the exchange's sandbox; the alias of another sandbox's or
        credential's secret is refused like a key sent where it is not bound."""
        sandbox = ex.identity.sandbox
        parts = self.parts

        def find(value: str) -> SecretValue | None:
            key = parts.ephemeral.by_alias(value)
            if key is None:
                return None
            if key.credential != credential or key.sandbox != sandbox:
                parts.telemetry.count("exfiltration_blocked", "secret")
                raise Refusal("exfiltration_blocked", "the request carries the alias of a "
                              "secret the provider minted for another sandbox or credential;"
                              " an alias works only for the sandbox it was given to, to its "
                              "credential's hosts", rule_of(ex.decision))
            return key.value
        return find

    async def apply(self, ex: Exchange, swap: Swap | None, path: str) -> None:
        """Put `swap`'s secret in the exchange (fetched now) and set the path it is
        forwarded with; a signing credential signs it, now or once the body is whole.
        Raises Refusal when the secret cannot be had."""
        head = ex.head
        signer: Signer | None = None
        if swap is not None and swap.minted is not None:  # the provider's secret for its alias
            path = credentials.apply(swap, head.headers, path, swap.minted.reveal())
            ex.injected(swap.credential.name, swap.credential.secret, swap.minted)
            swap = None
        if swap is not None:
            credential, name = swap.credential, swap.credential.secret
            value = await self._fetch(ex, swap)
            if credential.signs:  # AWS SigV4: re-signed, now or once the body is whole
                if self.parts.signers is None:
                    raise Refusal("credential_unavailable", f"credential {credential.name!r}"
                                  " signs requests, and this gateway has no signer for it",
                                  rule_of(ex.decision), credential=credential.name)
                ex.injected(credential.name, name, value)
                signer = self.parts.signers.signer(credential, value)
            else:
                path = credentials.apply(swap, head.headers, path, value.reveal())
                ex.injected(credential.name, name, value)
        ex.forward_path(path)
        if signer is not None:  # the signature covers the request line as forwarded
            ex.sign_with(signer)

    async def _fetch(self, ex: Exchange, swap: Swap) -> SecretValue:
        """The credential's secret from the store (or minted); raises Refusal."""
        credential = swap.credential
        try:
            return await self.parts.secrets.get(credential.secret)
        except Exception as exc:  # SecretUnavailable, or a store or mint failure
            reason = getattr(exc, "reason", None) or "the secret store failed"
            if credential.mint is not None:
                raise Refusal("credential_unavailable", f"credential {credential.name!r}"
                              f" ({credential.kind}) could not be minted: {reason}",
                              rule_of(ex.decision), credential=credential.name) from None
            raise Refusal("secret_unavailable", f"credential {credential.name!r} "
                          f"could not be fetched: {reason}", rule_of(ex.decision),
                          credential=credential.name) from None
