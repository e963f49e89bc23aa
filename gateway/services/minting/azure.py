"""`azure-entra`: Microsoft Entra ID access tokens from azure-identity.

The same credentials as the Key Vault store: ``workload`` (AKS workload identity: a
federated service-account token), ``managed`` (the VM's or pod's managed identity) or
``default`` (`DefaultAzureCredential`'s chain). ``authority`` selects a sovereign
cloud's login host (``login.microsoftonline.us``, …). Token requests go through
`TokenHttp` (TLS roots, `network.resolve`). After an upstream 401 the credential is
rebuilt, so azure-identity's own token cache cannot hand the rejected token back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from azure.core.exceptions import AzureError, ClientAuthenticationError
from azure.identity import CredentialUnavailableError
from azure.identity.aio import (
    DefaultAzureCredential,
    ManagedIdentityCredential,
    WorkloadIdentityCredential,
)

from gateway.core.policy.minted import MintSpec
from gateway.core.secret_value import MintedValue
from gateway.net.resolver import unguarded
from gateway.services.minting.base import MintContext, MintFailed, clean

if TYPE_CHECKING:
    from azure.core.credentials_async import AsyncTokenCredential

__all__ = ["EntraMinter"]


class EntraMinter:
    """Entra ID tokens for one scope."""

    def __init__(self, spec: MintSpec, context: MintContext) -> None:
        self.spec = spec
        self.context = context
        self.scope = spec.text("scope") or "https://cognitiveservices.azure.com/.default"
        self.kind = spec.text("credential") or "default"
        self._credential: AsyncTokenCredential | None = None

    def _build(self) -> AsyncTokenCredential:
        kwargs: dict[str, Any] = {"transport": self.context.http.azure_transport()}
        authority = self.spec.text("authority")
        if authority:
            kwargs["authority"] = authority
        client_id = self.spec.text("client_id")
        tenant_id = self.spec.text("tenant_id")
        try:
            if self.kind == "workload":
                return WorkloadIdentityCredential(
                    tenant_id=tenant_id, client_id=client_id,
                    token_file_path=self.spec.text("token_file"), **kwargs)
            if self.kind == "managed":
                kwargs.pop("authority", None)
                return ManagedIdentityCredential(client_id=client_id, **kwargs)
            if client_id:
                kwargs["managed_identity_client_id"] = client_id
                kwargs["workload_identity_client_id"] = client_id
            if tenant_id:
                kwargs["workload_identity_tenant_id"] = tenant_id
            return DefaultAzureCredential(**kwargs)
        except ValueError as exc:
            raise MintFailed(f"azure-identity credential {self.kind}: {clean(exc, 300)} (the "
                             "AKS workload identity webhook sets AZURE_TENANT_ID, "
                             "AZURE_CLIENT_ID and AZURE_FEDERATED_TOKEN_FILE)") from None

    async def mint(self, fresh: bool) -> MintedValue:
        if fresh and self._credential is not None:
            await self._credential.close()
            self._credential = None
        if self._credential is None:
            self._credential = self._build()
        try:
            with unguarded():
                token = await self._credential.get_token(self.scope)
        except CredentialUnavailableError as exc:
            raise MintFailed(f"no Entra ID credential ({self.kind}): "
                             f"{clean(_first_line(exc), 300)}") from None
        except ClientAuthenticationError as exc:
            raise MintFailed(f"Entra ID refused a token for {self.scope} ({self.kind}): "
                             f"{clean(_first_line(exc), 300)}") from None
        except AzureError as exc:
            raise MintFailed(f"Entra ID token request failed ({type(exc).__name__})",
                             transient=True) from None
        return MintedValue(token.token, lifetime=token.expires_on - self.context.clock())

    async def close(self) -> None:
        if self._credential is not None:
            await self._credential.close()
            self._credential = None


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "message", None) or exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
