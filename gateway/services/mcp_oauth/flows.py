"""A consent's flow: opened with its approval (the authorization URL with PKCE S256, a
single-use `state`, the `resource` indicator), and completed by the callback the
authorization server sends the person's browser to, which takes the flow by its `state`
(once), exchanges the code, writes the grant and closes the approval."""

from __future__ import annotations

import secrets as random
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from gateway.core.approvals import Approval, Asked, new_id
from gateway.core.identity import Identity
from gateway.core.policy.ask_rule import Ask
from gateway.services.approvals import ApprovalService
from gateway.services.mcp_oauth.discovery import ServerInfo
from gateway.services.mcp_oauth.grants import FLOW, GRANT, Grants, grant_line, kept_until
from gateway.services.mcp_oauth.http import OAuthError, OAuthHttp
from gateway.services.mcp_oauth.tokens import (
    Client,
    TokenSet,
    authorization_url,
    exchange,
    pkce,
)

__all__ = ["ConsentFailed", "ConsentFlows"]


class ConsentFailed(Exception):
    """The callback could not complete a consent (the message says why, for a person)."""


class ConsentFlows:
    """Consents opened and completed (see the module docstring)."""

    def __init__(self, grants: Grants, approvals: ApprovalService, http: OAuthHttp, *,
                 redirect_url: str, audit: Callable[[dict[str, Any]], None],
                 clock: Callable[[], float]) -> None:
        self.grants = grants
        self.approvals = approvals
        self.http = http
        self.redirect_url = redirect_url
        self.audit = audit
        self.clock = clock

    async def open(self, identity: Identity, key: str, owner: str, resource: str,
                   info: ServerInfo, client: Client, scopes: tuple[str, ...], spec: Ask
                   ) -> Approval:
        """A consent asked: its flow written under a new `state` (the PKCE verifier and
        the client's secret sealed in it) and its approval opened with the authorization
        URL; or the approval of the same consent already asked (its flow stands)."""
        state = random.token_urlsafe(32)
        verifier, challenge = pkce()
        url = authorization_url(info, client, self.redirect_url, scopes, state, challenge)
        parts = urlsplit(resource)
        flow = {"key": key, "owner": owner, "resource": resource, "host": parts.hostname,
                "info": info.to_doc(), "client_id": client.client_id,
                "auth_method": client.auth_method, "scopes": list(scopes),
                "sandbox": identity.sandbox, "policy": identity.policy}
        expires = self.clock() + spec.timeout
        await self.grants.put(FLOW, state, flow, {"verifier": verifier,
                                                  "client_secret": client.secret},
                              expires, None)
        asked = Asked("oauth", parts.hostname or "", parts.port or 443,
                      path=parts.path or "/")
        scope_text = " ".join(scopes) or "the server's default"
        approval, opened = await self.approvals.open_consent(
            identity, asked, f"the MCP server {resource} needs a person's OAuth consent "
            f"for {owner} (scopes: {scope_text}): open consent.url and sign in", spec,
            {"url": url, "resource": resource, "owner": owner, "issuer": info.issuer,
             "scopes": list(scopes)}, f"{key}|{' '.join(sorted(scopes))}")
        if not opened:  # (joined a consent already asked: its own URL and flow stand)
            await self.grants.remove(FLOW, state, self.clock())
            return approval
        found = await self.grants.get(FLOW, state)
        if found is not None and found.secret is not None:
            await self.grants.put(FLOW, state, {**found.doc, "approval": approval.id},
                                  found.secret, expires, found.rev)
        return approval

    async def complete(self, state: str, code: str | None, error: str | None
                       ) -> dict[str, Any]:
        """The authorization server sent the person back: the flow of `state` taken
        (once), its code exchanged, the grant written and its approval closed. Returns
        the grant's readable record; raises ConsentFailed."""
        flow = await self.grants.take(FLOW, state, self.clock()) if state else None
        if flow is None or flow.secret is None:
            raise ConsentFailed("this consent link is unknown, was already used, or expired"
                                "; ask again by retrying the request")
        doc, secret = flow.doc, flow.secret
        approval = doc.get("approval")
        if error is not None or not code:
            if isinstance(approval, str):
                await self.approvals.answer(approval, "deny", by="authorization server",
                                            note=f"the authorization server answered "
                                            f"{_code(error)}")
            raise ConsentFailed(f"the authorization server answered {_code(error)}; "
                                "nothing was granted")
        info = ServerInfo.from_doc(doc["info"])
        client = Client(str(doc["client_id"]), secret.get("client_secret"),
                        str(doc["auth_method"]))
        try:
            got = await exchange(self.http, info, client, code, str(secret["verifier"]),
                                 self.redirect_url, tuple(doc["scopes"]))
        except OAuthError as exc:
            raise ConsentFailed(f"the code could not be exchanged: {exc}") from None
        return await self.granted(doc, info, client, got, approval)

    async def granted(self, doc: dict[str, Any], info: ServerInfo, client: Client,
                       got: TokenSet, approval: Any) -> dict[str, Any]:
        """The grant of flow `doc` written (tokens `got`), then its approval closed as
        consented, in that order (a held request reads them in the other); audited."""
        key, now = str(doc["key"]), self.clock()
        grant = {"id": new_id("og"), "owner": doc["owner"], "resource": info.audience,
                 "server": doc["resource"], "host": doc["host"], "issuer": info.issuer,
                 "client_id": client.client_id, "auth_method": client.auth_method,
                 "scopes": list(got.scopes), "created": now, "issued": now,
                 "expires_at": got.expires_at, "info": info.to_doc(),
                 "approval": approval, "sandbox": doc["sandbox"], "policy": doc["policy"]}
        secret = {"access": got.access, "refresh": got.refresh,
                  "client_secret": client.secret}
        for _ in range(5):
            current = await self.grants.store.record_get(GRANT, key)
            if await self.grants.put(GRANT, key, grant, secret, kept_until(got, self.clock()),
                                     None if current is None else current[1]):
                break
        else:
            raise ConsentFailed("the grant could not be written (the state store is busy)")
        if isinstance(approval, str):
            await self.approvals.consented(approval, f"consent at {info.issuer}")
        self.audit(grant_line(grant, "grant", f"MCP OAuth grant {grant['id']} for "
                              f"{grant['owner']} at {grant['server']} (scopes: "
                              f"{' '.join(got.scopes) or 'none named'})", self.clock()))
        return grant


def _code(error: str | None) -> str:
    """An OAuth error code as a reason shows it."""
    if error and error.replace("_", "").isalnum() and len(error) <= 64:
        return error
    return "an error"
