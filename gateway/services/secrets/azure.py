"""`AzureKeyVaultStore`: secrets from Azure Key Vault, the production store.

Uses the official async SDK (``azure.keyvault.secrets.aio.SecretClient``) and
an ``azure.identity.aio`` credential: workload identity on AKS, a managed
identity on VMs, or ``DefaultAzureCredential``. The SDK's own retries are off
(``retry_total=0``): `SecretCache` owns retries, backoff and stale-if-error,
so a request never sleeps inside the SDK. Failures are translated into
`SecretNotFound` / `SecretStoreError` with messages an operator can act on.
"""

from __future__ import annotations

import email.utils
import re
import time
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.identity import CredentialUnavailableError
from azure.identity.aio import (
    DefaultAzureCredential,
    ManagedIdentityCredential,
    WorkloadIdentityCredential,
)
from azure.keyvault.secrets.aio import SecretClient

from gateway.core.secret_value import SecretValue
from gateway.services.secrets.base import (
    CREDENTIAL_KINDS,
    SecretNotFound,
    SecretStoreConfigError,
    SecretStoreError,
)

if TYPE_CHECKING:
    from azure.core.credentials_async import AsyncTokenCredential
    from azure.core.pipeline.transport import AsyncHttpTransport

CredentialKind = Literal["default", "workload", "managed"]

# Key Vault secret names: 1-127 characters from [0-9a-zA-Z-].
_SECRET_NAME = re.compile(r"[0-9a-zA-Z-]{1,127}")
_MAX_DETAIL = 300


class AzureKeyVaultStore:
    """Fetch the latest version of a secret from one Key Vault."""

    name = "azure-keyvault"

    def __init__(
        self,
        vault_url: str,
        credential: str = "default",
        client_id: str | None = None,
        verify_challenge_resource: bool = True,
        transport: AsyncHttpTransport[Any, Any] | None = None,
        credential_obj: AsyncTokenCredential | None = None,
        *,
        connection_timeout: float = 5.0,
        read_timeout: float = 10.0,
    ) -> None:
        """Create the client; nothing is sent until the first `fetch`.

        ``transport`` overrides how Key Vault (and the credential's token
        endpoint) are reached: trust anchors and name resolution only. It is
        owned by the caller. ``credential_obj``, if given, replaces the
        credential built from ``credential``/``client_id`` and is not closed here.
        """
        self.vault_url = _check_vault_url(vault_url)
        if credential not in CREDENTIAL_KINDS:
            raise SecretStoreConfigError(
                f"secrets.credential: {credential!r} is not one of {', '.join(CREDENTIAL_KINDS)}"
            )
        self.credential_kind = credential
        self.client_id = client_id
        self.connection_timeout = connection_timeout
        self.read_timeout = read_timeout
        self._owns_credential = credential_obj is None
        self._credential: AsyncTokenCredential = (
            credential_obj
            if credential_obj is not None
            else _build_credential(credential, client_id, transport)
        )
        client_kwargs: dict[str, Any] = {
            "verify_challenge_resource": verify_challenge_resource,
            "retry_total": 0,
        }
        if transport is not None:
            client_kwargs["transport"] = transport
        self._client = SecretClient(self.vault_url, self._credential, **client_kwargs)

    async def fetch(self, secret_name: str) -> SecretValue:
        """Return the latest version of ``secret_name``."""
        if not _SECRET_NAME.fullmatch(secret_name):
            raise SecretStoreError(
                f'secret name "{secret_name}" is not valid in Key Vault, which allows only '
                "letters, digits and '-' (1-127 characters); rename it in the policy and "
                "the vault (for example use '-' instead of '_' or '.')"
            )
        try:
            secret = await self._client.get_secret(
                secret_name,
                connection_timeout=self.connection_timeout,
                read_timeout=self.read_timeout,
            )
        except ResourceNotFoundError:
            raise SecretNotFound(
                secret_name,
                f'secret "{secret_name}" is not in Key Vault {self.vault_url}; create it '
                f"(az keyvault secret set --vault-name {self._vault_name} --name "
                f"{secret_name} --file <file>) or fix the policy's secret name",
            ) from None
        except CredentialUnavailableError as exc:
            raise SecretStoreError(
                f"no Azure credential available for Key Vault {self.vault_url} "
                f"(secrets.credential: {self.credential_kind}): {_detail(exc)}",
            ) from None
        except HttpResponseError as exc:
            raise self._http_error(secret_name, exc) from None
        except (ServiceRequestError, ServiceResponseError) as exc:
            raise SecretStoreError(
                f"could not reach Key Vault {self.vault_url}: {type(exc).__name__}: {_detail(exc)}",
                transient=True,
            ) from None
        except AzureError as exc:
            raise SecretStoreError(
                f"Key Vault {self.vault_url} request failed: {type(exc).__name__}: {_detail(exc)}",
                transient=True,
            ) from None
        except ValueError as exc:
            if "challenge" not in str(exc):
                raise
            raise SecretStoreError(
                f"Key Vault {self.vault_url} answered with an authentication challenge for "
                "another resource; refusing to send it a token. Use the vault's real URL "
                "(https://<name>.vault.azure.net), or set secrets.verify_challenge_resource: "
                "false only for a trusted private endpoint name",
            ) from None
        value = secret.value
        if not value:
            raise SecretStoreError(
                f'secret "{secret_name}" in Key Vault {self.vault_url} has an empty value; '
                "set a value"
            )
        return SecretValue(value)

    async def close(self) -> None:
        """Close the SDK client and, if this store created it, the credential."""
        await self._client.close()
        if self._owns_credential:
            await self._credential.close()

    @property
    def _vault_name(self) -> str:
        return (urlsplit(self.vault_url).hostname or "").split(".", 1)[0]

    def _identity(self) -> str:
        who = f"credential {self.credential_kind}"
        if self.client_id:
            who += f", client id {self.client_id}"
        return who

    def _http_error(self, secret_name: str, exc: HttpResponseError) -> SecretStoreError:
        status = exc.status_code
        code = _error_code(exc)
        code_note = f" ({code})" if code else ""
        request = getattr(exc.response, "request", None)
        from_vault = str(getattr(request, "url", "")).startswith(self.vault_url)
        if isinstance(exc, ClientAuthenticationError) and not from_vault:
            # The credential failed to get a token from Microsoft Entra ID.
            return SecretStoreError(
                f"could not get a token for Key Vault {self.vault_url} "
                f"({self._identity()}): {_detail(exc)}",
                status=status,
            )
        if status in (401, 403):
            return SecretStoreError(
                f"Key Vault {self.vault_url} returned {status}{code_note} for secret "
                f'"{secret_name}": the gateway\'s identity ({self._identity()}) may not read '
                'it; grant it the "Key Vault Secrets User" role on the vault (RBAC) or a '
                '"Get" secret access policy, and check the vault\'s network rules',
                status=status,
            )
        if status == 429 or (status is not None and status >= 500):
            what = "is throttling requests" if status == 429 else "is unavailable"
            code_part = f", {code}" if code else ""
            return SecretStoreError(
                f"Key Vault {self.vault_url} {what} (HTTP {status}{code_part}); retrying",
                status=status,
                retry_after=_retry_after(exc),
                transient=True,
            )
        return SecretStoreError(
            f"Key Vault {self.vault_url} returned HTTP {status}{code_note} for secret "
            f'"{secret_name}"',
            status=status,
        )


def _check_vault_url(vault_url: str) -> str:
    parts = urlsplit(vault_url.strip())
    if parts.scheme != "https" or not parts.hostname:
        raise SecretStoreConfigError(
            f"secrets.vault_url: {vault_url!r} must be an https URL such as "
            "https://<vault-name>.vault.azure.net"
        )
    if parts.path.strip("/") or parts.query or parts.fragment or parts.username:
        raise SecretStoreConfigError(
            f"secrets.vault_url: {vault_url!r} must be the vault's base URL only, "
            "like https://<vault-name>.vault.azure.net"
        )
    return f"https://{parts.netloc.lower()}"


def _build_credential(
    kind: str, client_id: str | None, transport: AsyncHttpTransport[Any, Any] | None
) -> AsyncTokenCredential:
    kwargs: dict[str, Any] = {}
    if transport is not None:
        kwargs["transport"] = transport
    try:
        if kind == "workload":
            return WorkloadIdentityCredential(client_id=client_id, **kwargs)
        if kind == "managed":
            if client_id:
                return ManagedIdentityCredential(client_id=client_id, **kwargs)
            return ManagedIdentityCredential(**kwargs)
        if client_id:
            kwargs["managed_identity_client_id"] = client_id
            kwargs["workload_identity_client_id"] = client_id
        return DefaultAzureCredential(**kwargs)
    except ValueError as exc:
        hint = ""
        if kind == "workload":
            hint = (
                " (the AKS workload identity webhook sets AZURE_TENANT_ID, AZURE_CLIENT_ID and "
                "AZURE_FEDERATED_TOKEN_FILE: label the pod azure.workload.identity/use: "
                '"true" and annotate its service account with the client id)'
            )
        raise SecretStoreConfigError(f"secrets.credential: {kind}: {_detail(exc)}{hint}") from None


def _detail(exc: BaseException) -> str:
    """First line of an SDK message, bounded (they can be long and multi-line)."""
    text = str(getattr(exc, "message", None) or exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return first if len(first) <= _MAX_DETAIL else first[: _MAX_DETAIL - 3] + "..."


def _error_code(exc: HttpResponseError) -> str | None:
    error = getattr(exc, "error", None)
    code = getattr(error, "code", None)
    return code if isinstance(code, str) and code else None


def _retry_after(exc: HttpResponseError) -> float | None:
    """Seconds from ``retry-after-ms``, ``x-ms-retry-after-ms`` or ``Retry-After``."""
    headers = getattr(exc.response, "headers", None)
    if headers is None:
        return None
    for name in ("retry-after-ms", "x-ms-retry-after-ms"):
        raw = headers.get(name)
        if raw:
            try:
                return max(0.0, float(raw) / 1000.0)
            except ValueError:
                pass
    raw = headers.get("Retry-After")
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
