"""The gateway's OAuth client at an authorization server (`clients.py`), with the real
secrets cache over the environment store: a client named in `mcp_oauth.clients` (its
secret fetched, the authentication method the server supports), an unknown or
unfetchable one refused, the client ID metadata document where the server takes it.
Registration (no HTTP here) is tests/integration/test_mcp_oauth.py's."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from gateway.core.policy.mcp_rule import McpOAuth
from gateway.services.mcp_oauth.clients import OAuthClients
from gateway.services.mcp_oauth.discovery import ServerInfo
from gateway.services.mcp_oauth.grants import Grants
from gateway.services.mcp_oauth.http import OAuthError
from gateway.services.mcp_oauth.seal import Sealer, ensure_key
from gateway.services.mcp_oauth.tokens import Client
from gateway.services.secrets.cache import SecretCache
from gateway.services.secrets.env import EnvStore
from gateway.services.state.base import MemoryState

CALLBACK = "https://gw.test/oauth/callback"
METADATA = "https://gw.test/oauth/client.json"


def _info(**fields: object) -> ServerInfo:
    return ServerInfo("https://mcp.test/mcp", "https://mcp.test/mcp", "https://as.test",
                      "https://as.test/authorize", "https://as.test/token",
                      **fields)  # type: ignore[arg-type]


def _clients(tmp_path: Path, metadata: str | None = METADATA) -> OAuthClients:
    secrets = SecretCache(EnvStore({"SANDBOX_GATEWAY_SECRET_CORP_SECRET": "s3cret"}))
    grants = Grants(MemoryState(), Sealer(ensure_key(tmp_path / "key")))
    return OAuthClients(grants, None, secrets, redirect_url=CALLBACK,  # type: ignore[arg-type]
                        named={"corp": ("corp-id", "corp-secret"), "public": ("pub-id", None),
                               "lost": ("lost-id", "not-there")},
                        metadata_url=metadata, holder="proc-1", clock=time.time)


@pytest.mark.parametrize(("name", "info", "expected"), [
    ("corp", _info(), Client("corp-id", "s3cret", "client_secret_basic")),
    ("corp", _info(auth_methods=("client_secret_post",)),
     Client("corp-id", "s3cret", "client_secret_post")),
    ("public", _info(), Client("pub-id", None, "none")),
    ("auto", _info(client_id_metadata=True), Client(METADATA)),
])
def test_the_client_a_rule_names(tmp_path: Path, name: str, info: ServerInfo,
                                 expected: Client) -> None:
    found = asyncio.run(_clients(tmp_path).of(info, McpOAuth(client=name)))
    assert found == expected


@pytest.mark.parametrize(("name", "message"), [
    ("nobody", "client 'nobody' is not in the gateway's mcp_oauth.clients"),
    ("lost", "the secret 'not-there' of client 'lost' could not be fetched"),
])
def test_a_client_that_cannot_be_used_is_refused(tmp_path: Path, name: str,
                                                 message: str) -> None:
    with pytest.raises(OAuthError, match=message):
        asyncio.run(_clients(tmp_path).of(_info(), McpOAuth(client=name)))


def test_the_metadata_document_names_only_the_callback(tmp_path: Path) -> None:
    assert _clients(tmp_path).metadata() == {
        "client_id": METADATA, "client_name": "sandbox-gateway", "redirect_uris": [CALLBACK],
        "grant_types": ["authorization_code", "refresh_token"],
        "response_types": ["code"], "token_endpoint_auth_method": "none"}
    assert _clients(tmp_path, metadata=None).metadata() is None
