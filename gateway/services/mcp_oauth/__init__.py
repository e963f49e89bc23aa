"""The gateway as MCP servers' OAuth client (issue 44, docs/mcp-oauth.md): the core's
`McpTokens` port.

A request on a rule with `mcp.oauth` finds the grant of its owner (`grant_owner`: its
sandbox, or its policy) for its server in the state store (`grants.py`, sealed), the
access token refreshed shortly before it expires (one process refreshes, under a lease;
the others wait for its result). Without a grant the request is held while a person
consents: the server and its authorization server are discovered (`discovery.py`), the
gateway's client found (`tokens.py`: a configured one, a client ID metadata document, or
dynamic registration), and an approval of kind ``oauth`` opened whose `consent.url` is
the authorization URL (PKCE S256, `state`, the `resource` indicator). The person opens it
and signs in; the authorization server sends their browser to the gateway's callback
(`complete`), which takes the flow by its `state` (single use, expiring with the
approval), exchanges the code and writes the grant; the held request then goes on.

A server that refuses the gateway's token (401) marks the grant stale (the next request
refreshes it, or asks again); one that asks for more scopes (403 `insufficient_scope`)
marks it for a step-up consent with the union of the scopes (`rejected`).

Its parts: `grants.py` (the records, sealed), `clients.py` (the gateway's client at an
authorization server), `flows.py` (a consent opened and completed by the callback),
`discovery.py`, `tokens.py` (the OAuth requests), `seal.py`, `http.py`; this module holds
a grant's life (read, refreshed under a lease, marked, revoked) and the held request.

Audit lines (`engine: mcp_oauth`) name the grant (id, owner, resource, scopes), never a
token: `grant` when a consent completes, `revoke` when one is revoked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

from gateway.core.approvals import Approval, new_id
from gateway.core.identity import Identity
from gateway.core.mcp_oauth import Challenge, McpToken, grant_owner, oauth_failed
from gateway.core.policy.ask_rule import Ask
from gateway.core.policy.mcp_rule import McpOAuth
from gateway.core.ports import Secrets
from gateway.core.refusal import Refusal
from gateway.core.secret_value import MintedValue, SecretValue
from gateway.services.approvals import ApprovalService
from gateway.services.mcp_oauth.clients import LEASE, OAuthClients
from gateway.services.mcp_oauth.discovery import ServerInfo, discover
from gateway.services.mcp_oauth.flows import ConsentFailed, ConsentFlows
from gateway.services.mcp_oauth.grants import GRANT, KEEP, Grants, Stored, grant_line, kept_until
from gateway.services.mcp_oauth.http import OAuthError, OAuthHttp
from gateway.services.mcp_oauth.seal import Sealer
from gateway.services.mcp_oauth.tokens import Client, refresh, revoke
from gateway.services.state.base import Records

__all__ = ["ConsentFailed", "McpOAuthService"]

log = logging.getLogger("sandbox_gateway.mcp_oauth")

POLL = 0.2  # seconds between a held request's looks at its grant and approval
AHEAD = 60.0  # an access token is refreshed this long before it expires (at most)


class McpOAuthService:
    """See the module docstring."""

    def __init__(self, store: Records, approvals: ApprovalService, http: OAuthHttp,
                 sealer: Sealer, *, secrets: Secrets, redirect_url: str,
                 clients: Mapping[str, tuple[str, str | None]] | None = None,
                 client_metadata_url: str | None = None,
                 audit: Callable[[dict[str, Any]], None] = lambda line: None,
                 clock: Callable[[], float] = time.time) -> None:
        self.grants = Grants(store, sealer)
        self.approvals = approvals
        self.http = http
        self.audit = audit
        self.clock = clock
        self.holder = new_id("proc")
        self.clients = OAuthClients(self.grants, http, secrets, redirect_url=redirect_url,
                                    named=clients or {}, metadata_url=client_metadata_url,
                                    holder=self.holder, clock=clock)
        self.flows = ConsentFlows(self.grants, approvals, http, redirect_url=redirect_url,
                                  audit=audit, clock=clock)
        self._live: dict[str, tuple[str, SecretValue]] = {}  # key -> (host, tokens)
        self._version = 0
        self._challenges: dict[str, Challenge] = {}  # key -> the server's last challenge
        self._tasks: set[asyncio.Task[None]] = set()
        self._read_cache: dict[str, tuple[int, Stored | None]] = {}  # key -> (version, grant)
        self._made: dict[str, tuple[Stored, McpToken]] = {}  # key -> (record, its token)

    # -- the port: leak markers ---------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def live(self) -> list[tuple[str, SecretValue]]:
        """Every token this process holds, with the host it is bound to."""
        return list(self._live.values())

    def _keep(self, key: str, host: str, value: SecretValue | None) -> None:
        before = self._live.get(key)
        if value is None:
            if self._live.pop(key, None) is not None:
                self._version += 1
        elif before is None or before[1] != value:
            self._live[key] = (host, value)
            self._version += 1

    # -- the port: the token of a request -----------------------------------------------

    async def token(self, identity: Identity, resource: str, oauth: McpOAuth
                    ) -> McpToken | None:
        """The access token for `identity` at `resource` (refreshed if due), or None:
        a consent is needed (no grant, a step-up, scopes the rule asks for that the
        grant lacks, an expired token that cannot be refreshed)."""
        owner = grant_owner(oauth, identity)
        key = f"{owner}|{resource}"
        stored = await self._read(key)
        if not _serves(stored, oauth):
            return None
        if self._due(stored):
            stored = await self._refreshed(key, stored)
            if stored is None or stored.secret is None:
                return None
        made = self._made.get(key)
        if made is not None and made[0] is stored:  # (the same record: the same token)
            return made[1]
        secret = stored.secret
        assert secret is not None
        value = MintedValue(secret["access"], parts=tuple(
            t for t in (secret["access"], secret.get("refresh")) if t))
        self._keep(key, str(stored.doc["host"]), value)
        token = McpToken(str(stored.doc["id"]), owner, str(stored.doc["resource"]),
                         tuple(stored.doc.get("scopes", [])), value)
        if len(self._made) > 4096:
            self._made.clear()
        self._made[key] = (stored, token)
        return token

    async def _read(self, key: str) -> Stored | None:
        """The grant at `key`: this process's copy while no grant was written anywhere
        since it was read (`record_version`, no I/O), else read from the store."""
        version = self.grants.version()
        cached = self._read_cache.get(key)
        if cached is not None and cached[0] == version:
            return cached[1]
        stored = await self.grants.get(GRANT, key)
        if len(self._read_cache) > 4096:
            self._read_cache.clear()
        self._read_cache[key] = (version, stored)
        return stored

    def _due(self, stored: Stored) -> bool:
        """Is the grant's access token to be refreshed now (marked stale, or near its
        expiry: a tenth of its lifetime, at most `AHEAD`, before)?"""
        expires = stored.doc.get("expires_at")
        now = self.clock()
        return bool(stored.doc.get("stale")) or (expires is not None and now >= expires - min(
            AHEAD, (expires - float(stored.doc.get("issued", now))) / 10))

    async def _refreshed(self, key: str, stored: Stored) -> Stored | None:
        """The grant with fresh tokens (refreshed here under the lease, or by the
        process holding it); None when the grant cannot be used any more."""
        now = self.clock()
        if not await self.grants.store.record_put(LEASE, key, {"holder": self.holder},
                                                  now + 20, None):
            for _ in range(100):  # another process refreshes: wait for its result
                await asyncio.sleep(0.1)
                again = await self.grants.get(GRANT, key)
                if again is None or again.rev != stored.rev:
                    return again
            return None
        try:
            # (read again under the lease: this process's copy may predate a refresh
            # another one finished a moment ago, whose rotated refresh token replaced
            # the one in hand; refreshing with the spent one would lose the grant)
            current = await self.grants.get(GRANT, key)
            if current is None or current.secret is None:
                return None
            if current.rev != stored.rev and not self._due(current):
                return current
            return await self._refresh(key, current)
        finally:
            found = await self.grants.store.record_get(LEASE, key)
            if found is not None and found[0].get("holder") == self.holder:
                await self.grants.store.record_put(LEASE, key, found[0], self.clock(),
                                                   found[1])

    async def _refresh(self, key: str, stored: Stored) -> Stored | None:
        secret, doc = stored.secret or {}, stored.doc
        expires = doc.get("expires_at")
        usable = not doc.get("stale") and (expires is None or self.clock() < expires)
        if not secret.get("refresh"):
            return stored if usable else await self._forget(key, "expired, no refresh token")
        info = ServerInfo.from_doc(doc["info"])
        client = Client(str(doc["client_id"]), secret.get("client_secret"),
                        str(doc.get("auth_method", "none")))
        try:
            got = await refresh(self.http, info, client, secret["refresh"],
                                tuple(doc.get("scopes", [])))
        except OAuthError as exc:
            log.warning("MCP OAuth grant %s: refresh failed: %s", doc.get("id"), exc)
            return stored if usable else await self._forget(key, f"refresh failed: {exc}")
        new = {**doc, "expires_at": got.expires_at, "issued": self.clock(), "stale": False,
               "scopes": list(got.scopes)}
        written = await self.grants.put(GRANT, key, new, {**secret, "access": got.access,
                                                          "refresh": got.refresh},
                                        kept_until(got, self.clock()), stored.rev)
        return await self.grants.get(GRANT, key) if written else None

    async def _forget(self, key: str, why: str) -> Stored | None:
        """Remove the grant at `key` (it cannot be used any more): None."""
        log.info("MCP OAuth grant of %s forgotten: %s", key.split("|", 1)[0], why)
        await self.grants.remove(GRANT, key, self.clock())
        self._keep(key, "", None)
        return None

    # -- the port: a server refused the token -------------------------------------------

    def rejected(self, token: McpToken, resource: str, challenge: Challenge | None) -> None:
        """The server answered 401 (the grant is marked stale: refreshed, or asked
        again) or 403 `insufficient_scope` (marked for a step-up consent with the
        union of the scopes). Runs on in the background; the answer is not held."""
        key = f"{token.owner}|{resource}"
        if challenge is not None:
            self._challenges[key] = challenge
        task = asyncio.get_running_loop().create_task(self._mark(key, token, challenge))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _mark(self, key: str, token: McpToken, challenge: Challenge | None) -> None:
        try:
            for _ in range(5):
                stored = await self.grants.get(GRANT, key)
                if stored is None or stored.doc.get("id") != token.grant or \
                        stored.secret is None:
                    return
                doc = dict(stored.doc)
                if challenge is not None and challenge.insufficient_scope:
                    doc["step_up"] = True  # (no scope named: the server's own are asked)
                    doc["named"] = bool(challenge.scopes)
                    doc["wanted"] = sorted(set(doc.get("scopes", [])) | set(challenge.scopes))
                else:
                    doc["stale"] = True
                raw = await self.grants.store.record_get(GRANT, key)
                if raw is not None and raw[1] == stored.rev and \
                        await self.grants.store.record_put(GRANT, key, {**raw[0], **doc},
                                                           self.clock() + KEEP, stored.rev):
                    return
        except Exception:  # (the store away: the next request finds the grant as it was)
            log.exception("MCP OAuth grant %s: could not be marked", token.grant)

    # -- the port: consent ---------------------------------------------------------------

    async def consent(self, identity: Identity, resource: str, oauth: McpOAuth, spec: Ask,
                      rule: str | None) -> None:
        """Hold until a person consents for `identity` at `resource` (a grant written,
        by this ask or another), or raise the Refusal: declined (`approval_denied`), no
        answer in time (`approval_timeout`), discovery or registration failed
        (`mcp_oauth_failed`). Returns at once when the store already holds a grant that
        serves (written by another process this one has not heard of yet)."""
        owner = grant_owner(oauth, identity)
        key = f"{owner}|{resource}"
        current = await self.grants.get(GRANT, key)
        if _serves(current, oauth) and not self._due(current):
            # (written by another process a moment ago, and this one's copy predates it
            # while the notice of its write is on its way: no one is asked again)
            self._read_cache.pop(key, None)
            return
        wanted = list(oauth.scopes) + list((current.doc.get("wanted") or [])
                                           if current is not None else [])
        try:
            info = await discover(self.http, resource, self._challenges.get(key))
            client = await self.clients.of(info, oauth)
        except OAuthError as exc:
            raise oauth_failed(str(exc), rule) from None
        unnamed = current is not None and current.doc.get("step_up") and \
            not current.doc.get("named")
        scopes = tuple(dict.fromkeys(
            wanted + list(info.scopes_supported if unnamed or not wanted else ())))
        approval = await self.flows.open(identity, key, owner, resource, info, client,
                                         scopes, spec)
        await self._wait(approval, key, rule)
        # (the grant was read from the store; this process's copy may predate it while
        # the notice of its write is on its way: `token` reads it again)
        self._read_cache.pop(key, None)

    async def _wait(self, approval: Approval, key: str, rule: str | None) -> None:
        """Hold until the grant `approval` asks for is written (or one written since it
        was opened), or the approval ends without one (raises the Refusal). Every POLL
        seconds, and bounded by the approval's own expiry (`settled` times it out).

        The callback writes the grant before it closes the approval (`_granted`), so the
        order of these reads matters: a grant read *before* the approval was seen
        completed may predate both writes (a read that missed the grant, then the
        callback's two writes, then the approval read completed). The grant is read
        again after the approval says so: that read follows the approval's write, hence
        the grant's; only a grant gone or changed meanwhile (revoked, replaced, marked
        for a step-up) fails it, at once."""
        while True:
            if _answers(await self.grants.get(GRANT, key), approval):
                return
            current = await self.approvals.settled(approval.id)
            if current.state == "denied":
                note = f": {current.note}" if current.note else ""
                raise Refusal("approval_denied", f"a person ({current.by}) declined the "
                              f"OAuth consent of approval {approval.id}{note}; do not retry "
                              "it - ask them", f"approval:{approval.id}")
            if current.state == "timeout":
                raise Refusal("approval_timeout", f"no one completed the OAuth consent of "
                              f"approval {approval.id} within "
                              f"{current.expires - current.created:g}s; it is asked again "
                              "on the next request", f"approval:{approval.id}")
            if current.state == "approved":
                if _answers(await self.grants.get(GRANT, key), approval):
                    return
                raise oauth_failed(f"approval {approval.id} was completed, and its grant "
                                   "cannot serve this request any more (revoked, replaced "
                                   "or marked for a step-up meanwhile); retry the request",
                                   rule)
            await asyncio.sleep(POLL)

    # -- the callback and the metadata document (admin listener) -----------------------

    async def complete(self, state: str, code: str | None, error: str | None
                       ) -> dict[str, Any]:
        """The callback: the consent of `state` completed (`flows.py`); raises
        ConsentFailed."""
        return await self.flows.complete(state, code, error)

    def client_metadata(self) -> dict[str, Any] | None:
        return self.clients.metadata()

    # -- listing and revoking (admin API, CLI, console) ---------------------------------

    async def list(self) -> list[dict[str, Any]]:
        """Every grant (no token), newest first."""
        found = await self.grants.grants()
        return sorted(({k: v for k, v in g.items() if k not in ("info",)} for g in found),
                      key=lambda g: -float(g.get("created", 0)))

    async def revoke(self, grant: str, by: str) -> dict[str, Any]:
        """Forget grant `grant` on every process, and ask its authorization server to
        revoke its tokens (RFC 7009, where it can). Raises KeyError."""
        for doc in await self.grants.grants():
            if doc.get("id") != grant:
                continue
            key = f"{doc['owner']}|{doc['server']}"
            taken = await self.grants.take(GRANT, key, self.clock())
            if taken is None:
                break
            self._keep(key, "", None)
            secret = taken.secret or {}
            info = ServerInfo.from_doc(taken.doc["info"])
            client = Client(str(taken.doc["client_id"]), secret.get("client_secret"),
                            str(taken.doc.get("auth_method", "none")))
            told = False
            for hint in ("refresh_token", "access_token"):
                token = secret.get("refresh" if hint == "refresh_token" else "access")
                if token:
                    told = await revoke(self.http, info, client, token, hint) or told
            self.audit(grant_line(
                taken.doc, "revoke", f"MCP OAuth grant {grant} for {taken.doc['owner']} at "
                f"{taken.doc['server']} revoked by {by}" + ("" if told else " (the server "
                "was not told: no revocation endpoint, or it refused)"), self.clock()))
            return {k: v for k, v in taken.doc.items() if k != "info"}
        raise KeyError(grant)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _serves(stored: Stored | None, oauth: McpOAuth) -> TypeGuard[Stored]:
    """Can `stored` serve a rule asking `oauth` (it opens, no step-up is due, it holds
    every scope the rule asks for)?"""
    return stored is not None and stored.secret is not None and \
        not stored.doc.get("step_up") and \
        set(oauth.scopes) <= set(stored.doc.get("scopes", []))


def _answers(stored: Stored | None, approval: Approval) -> bool:
    """Is `stored` a grant written for `approval` (or since it was opened): what a
    request held on it waits for?"""
    return stored is not None and not stored.doc.get("step_up") and \
        float(stored.doc.get("created", 0)) >= approval.created
