"""`policy check --secrets`: every secret a credential names exists and has its shape.

For key credentials the `secret:`; for minted ones the secrets their fields name
(a GitHub App's private key must be an RSA key in PEM, a Google key a service
account's JSON, the rest non-empty). Values are read from the configured store and
never printed: a problem names the credential, the field's secret and what is wrong.
"""

from __future__ import annotations

import json

from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from gateway.core.policy import PolicySet
from gateway.services.secrets.base import SecretError, SecretStore

__all__ = ["check_secrets"]


def _shape_problem(kind: str, field: str, text: str) -> str | None:
    """What is wrong with a secret's value for its field (None: fine)."""
    if kind == "github-app" and field == "private_key":
        try:
            key = load_pem_private_key(text.encode(), password=None)
        except (ValueError, TypeError):
            return "is not a private key in PEM (the GitHub App's .pem file)"
        if not isinstance(key, rsa.RSAPrivateKey):
            return "is not an RSA private key (GitHub Apps sign with RS256)"
    if kind == "gcp-service-account" and field == "key":
        try:
            info = json.loads(text)
        except ValueError:
            return "is not JSON (a service account key file)"
        if not isinstance(info, dict) or info.get("type") != "service_account" or \
                not all(info.get(k) for k in ("client_email", "private_key", "token_uri")):
            return "is not a service account key (type, client_email, private_key, token_uri)"
    return None


async def check_secrets(policy_set: PolicySet, store: SecretStore) -> list[str]:
    """Problems (``source: message``) with the secrets the credentials name."""
    problems: list[str] = []
    for credential in policy_set.credentials.values():
        if credential.mint is None:
            wanted = [("secret", credential.secret)]
        else:
            wanted = list(credential.mint.secret_fields)
        for field, name in wanted:
            where = f'{credential.source}: credential "{credential.name}" {field}: secret ' \
                    f'"{name}"'
            try:
                value = await store.fetch(name)
            except SecretError as exc:
                problems.append(f"{where}: {exc}")
                continue
            problem = _shape_problem(credential.kind, field, value.reveal())
            if problem is not None:
                problems.append(f"{where} {problem}")
    return problems
