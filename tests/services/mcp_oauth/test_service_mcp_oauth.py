"""`McpOAuthService` against a real state store (memory) and the real approvals service,
where the order of two processes' reads and writes decides the answer (the end-to-end
flows are tests/integration/test_mcp_oauth.py): a held request whose consent completes
between its read of the grant and its read of the approval goes on with the grant; a
process that has not heard of a grant another process wrote a moment ago uses it rather
than asking a person again. No HTTP is needed: the gateway's OAuth client here refuses
every destination, so a test that reached the network would fail closed."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.core.addresses import Pinned
from gateway.core.identity import Identity
from gateway.core.mcp_oauth import resource_uri
from gateway.core.policy.ask_rule import Ask
from gateway.core.policy.mcp_rule import McpOAuth
from gateway.core.refusal import Refusal
from gateway.core.secret_value import SecretValue
from gateway.services.approvals import ApprovalService
from gateway.services.mcp_oauth import McpOAuthService
from gateway.services.mcp_oauth.discovery import ServerInfo
from gateway.services.mcp_oauth.grants import GRANT, Grants
from gateway.services.mcp_oauth.http import OAuthHttp
from gateway.services.mcp_oauth.seal import Sealer, ensure_key
from gateway.services.mcp_oauth.tokens import Client, TokenSet
from gateway.services.state.base import MemoryState

RESOURCE = "https://mcp.test/mcp"
OAUTH = McpOAuth(scopes=("mcp",), consent="policy")
OWNER = "policy:agent"
KEY = f"{OWNER}|{RESOURCE}"


class Refusing:
    """The destination guard of a gateway that may reach no authorization server."""

    async def check(self, host: str, port: int) -> Pinned:
        raise Refusal("destination_refused", f"{host}:{port}: this test reaches no server")


class NoSecrets:
    async def get(self, name: str) -> SecretValue:
        raise LookupError(name)

    def invalidate(self, name: str, rejected: SecretValue | None = None) -> None:
        return None

    def known_items(self) -> list[tuple[str, SecretValue]]:
        return []


class Seen:
    """One process's view of a shared store (`Records`): reads and writes reach the
    store at once (`shared`), as Redis's do, and another process's write is not heard
    of (`record_version` stays), as a Redis replica hears it on its channel only a
    moment later. `on_missing`, when set, runs once after a read of a grant that found
    none, before that read returns: another process's writes landing between this
    read and the next."""

    def __init__(self, shared: MemoryState) -> None:
        self.shared = shared
        self.heard = 0
        self.on_missing: Callable[[], Awaitable[Any]] | None = None

    async def record_get(self, kind: str, key: str) -> tuple[dict[str, Any], int] | None:
        found = await self.shared.record_get(kind, key)
        if found is None and kind == GRANT and self.on_missing is not None:
            then, self.on_missing = self.on_missing, None
            await then()
        return found

    async def record_list(self, kind: str) -> list[dict[str, Any]]:
        return await self.shared.record_list(kind)

    async def record_put(self, kind: str, key: str, doc: dict[str, Any], expires_at: float,
                         rev: int | None) -> bool:
        return await self.shared.record_put(kind, key, doc, expires_at, rev)

    def record_version(self, kind: str) -> int:
        return self.heard

    def record_wakeup(self) -> asyncio.Event | None:
        return None


def _identity() -> Identity:
    now = time.time()
    return Identity(sandbox="sandbox-1", policy="agent", jti="j", scope={}, issued_at=now,
                    expires_at=now + 900, lifetime_end=now + 3600)


def _service(store: Seen, tmp_path: Path) -> McpOAuthService:
    approvals = ApprovalService(store, audit=lambda line: None)
    http = OAuthHttp(Refusing(), ssl.create_default_context())
    return McpOAuthService(store, approvals, http, Sealer(ensure_key(tmp_path / "key")),
                           secrets=NoSecrets(), redirect_url="https://gw.test/oauth/callback")


INFO = ServerInfo(resource=RESOURCE, audience=resource_uri("https", "mcp.test", 443, "/mcp"),
                  issuer="https://auth.test", authorization_endpoint="https://auth.test/a",
                  token_endpoint="https://auth.test/token")
FLOW = {"key": KEY, "owner": OWNER, "resource": RESOURCE, "host": "mcp.test",
        "sandbox": "sandbox-1", "policy": "agent"}


def test_a_consent_completed_between_the_waiters_two_reads_lets_it_go_on(
        tmp_path: Path) -> None:
    """The held request reads the grant (none yet); the callback, on another process,
    writes the grant and closes the approval as completed; the request then reads the
    approval: completed. It reads the grant again and goes on with its token (it was
    refused `mcp_oauth_failed`, "no grant was written")."""
    async def run() -> None:
        shared = MemoryState()
        waiter_view, callback_view = Seen(shared), Seen(shared)
        waiter = _service(waiter_view, tmp_path)
        callback = _service(callback_view, tmp_path)
        approval = await waiter.flows.open(_identity(), KEY, OWNER, RESOURCE, INFO,
                                     Client("client-1"), ("mcp",), Ask(timeout=30))
        got = TokenSet("access-token-1", "refresh-token-1", time.time() + 3600, ("mcp",))
        waiter_view.on_missing = lambda: callback.flows.granted(FLOW, INFO, Client("client-1"),
                                                           got, approval.id)
        await asyncio.wait_for(waiter._wait(approval, KEY, None), 10)
        assert waiter_view.on_missing is None  # (the interleaving happened)
        assert (await waiter.approvals.approval(approval.id)).state == "approved"
        token = await waiter.token(_identity(), RESOURCE, OAUTH)
        assert token is not None and token.value.reveal() == "access-token-1"
    asyncio.run(run())


async def _revoke(service: McpOAuthService) -> None:
    assert await service.grants.remove(GRANT, KEY, time.time())


async def _mark_step_up(service: McpOAuthService) -> None:
    found = await service.grants.get(GRANT, KEY)
    assert found is not None and found.secret is not None
    assert await service.grants.put(GRANT, KEY, {**found.doc, "step_up": True},
                                    found.secret, time.time() + 60, found.rev)


@pytest.mark.parametrize("then", [_revoke, _mark_step_up], ids=["revoked", "step-up"])
def test_a_grant_gone_or_changed_before_the_completed_approval_is_read_fails_closed(
        tmp_path: Path, then: Callable[[McpOAuthService], Awaitable[None]]) -> None:
    """Completed, and the grant revoked (or marked for a step-up by another request's
    403) before the held request read it: refused `mcp_oauth_failed` at once, saying
    so (a marked grant held it until the approval's record expired, a day later)."""
    async def run() -> None:
        shared = MemoryState()
        view = Seen(shared)
        service = _service(view, tmp_path)
        approval = await service.flows.open(_identity(), KEY, OWNER, RESOURCE, INFO,
                                      Client("client-1"), ("mcp",), Ask(timeout=30))
        got = TokenSet("access-token-2", None, time.time() + 3600, ("mcp",))

        async def granted_then_changed() -> None:
            grant = await service.flows.granted(FLOW, INFO, Client("client-1"), got, approval.id)
            assert grant["owner"] == OWNER
            await then(service)

        view.on_missing = granted_then_changed
        with pytest.raises(Refusal) as refused:
            await asyncio.wait_for(service._wait(approval, KEY, "agent.yaml#0"), 10)
        assert refused.value.code == "mcp_oauth_failed"
        assert approval.id in refused.value.reason and "revoked" in refused.value.reason
    asyncio.run(run())


def test_a_grant_another_process_wrote_is_used_before_this_one_hears_of_it(
        tmp_path: Path) -> None:
    """This process read "no grant" and keeps that copy until it hears of a write; a
    grant written meanwhile by another process (its callback) is found when a request
    would ask for consent: used, no approval opened, no server reached (the first
    fix's second half: a request released from its wait reads the grant it waited on,
    not this process's older copy)."""
    async def run() -> None:
        shared = MemoryState()
        view = Seen(shared)
        service = _service(view, tmp_path)
        assert await service.token(_identity(), RESOURCE, OAUTH) is None  # (copy: none)
        now = time.time()
        doc = {"id": "og_1", "owner": OWNER, "resource": INFO.audience, "server": RESOURCE,
               "host": "mcp.test", "scopes": ["mcp"], "created": now, "issued": now,
               "expires_at": now + 3600, "info": INFO.to_doc()}
        other = Grants(shared, Sealer(ensure_key(tmp_path / "key")))
        assert await other.put(GRANT, KEY, doc, {"access": "access-token-3"}, now + 3600, None)
        assert await service.token(_identity(), RESOURCE, OAUTH) is None  # (not heard yet)
        await service.consent(_identity(), RESOURCE, OAUTH, Ask(timeout=30), None)
        token = await service.token(_identity(), RESOURCE, OAUTH)
        assert token is not None and token.value.reveal() == "access-token-3"
        assert await service.approvals.approvals() == []
    asyncio.run(run())
