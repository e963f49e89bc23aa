"""Ask mode's shared state: approvals waiting for a person, the answers, and the grants
they leave (the core's `Approvals` port; what is asked and what an answer means is
`gateway/core/approvals.py`).

Everything lives in the state store's shared records, so every worker and replica sees
the same asks and grants: a request held on one process is released by an answer given
on another, grants survive restarts and lapse on time. The same thing asked twice by a
sandbox waits on one approval (a claim record per sandbox and thing asked). An answer
writes its grant before the approval says `approved`, so a released request never finds
its grant missing; a timeout and an answer race on the approval's revision, and exactly
one of them wins.

**Pushed, not only polled.** Every `WATCH` seconds (`RecordWatcher`) a process asks the
store whether a grant, an approval or a tool pin was written anywhere (`record_version`:
SQLite's change counter, read only when the file changed; Redis's `record` events on its
pub/sub channel): a new grant is loaded at once and every held request re-checks, so one
a grant covers is let through within a tenth of a second on every worker and replica,
whichever approval it waits on (its own approval is then closed as approved, when the
grant covers all it asks). Before opening an ask a process re-reads the grants, so the
request right after a grant, on a process that had not loaded it yet, is not asked
again. Each waiting process still reads its approval every `POLL` seconds (a lost
pub/sub message delays nothing longer).

Audit lines (no connection: `engine: approvals`): `ask` when an approval is opened,
`approve` / `deny` / `timeout` when it ends, `revoke` when a grant is revoked; the held
requests' own lines are the gate's (`rule: grant:<id>`, or `approval_denied` /
`approval_timeout`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from gateway.core import approvals as core
from gateway.core.approvals import Approval, Asked, Grant
from gateway.core.identity import Identity
from gateway.core.mcp_pins import KIND as PIN_KIND
from gateway.core.policy import PolicySet, Request
from gateway.core.policy.ask_rule import Ask
from gateway.core.ports import SILENT, Telemetry
from gateway.services.approvals.lines import approval_line, revoked_line
from gateway.services.approvals.notify import Webhooks
from gateway.services.approvals.pins import ToolPinStore
from gateway.services.approvals.proposal import Proposal, propose
from gateway.services.approvals.watch import WATCH, RecordWatcher
from gateway.services.state.base import Records, StateUnavailable

__all__ = ["POLL", "WATCH", "ApprovalService", "NotFound"]

log = logging.getLogger("sandbox_gateway.approvals")

POLL = 0.2  # seconds between a waiting process's reads of its approval
FOREVER = 100 * 365 * 86400.0  # a grant without expiry, as the store keeps it
_APPROVAL, _CLAIM, _GRANT = "approval", "asking", "grant"


class NotFound(KeyError):
    """No such approval or grant (or it has expired)."""


class ApprovalService:
    """See the module docstring. `audit` takes audit lines; `policies` the live policy
    set and `directory` its files (for `always` proposals, written under `proposals`)."""

    def __init__(self, store: Records, *, audit: Callable[[dict[str, Any]], None],
                 webhooks: Webhooks | None = None, telemetry: Telemetry = SILENT,
                 clock: Callable[[], float] = time.time, retention: float = 86400.0,
                 policies: Callable[[], PolicySet] | None = None,
                 directory: Path | None = None, proposals: Path | None = None) -> None:
        self.store = store
        self.audit = audit
        self.webhooks = webhooks
        self.telemetry = telemetry
        self.clock = clock
        self.retention = retention
        self.policies = policies
        self.directory = directory
        self.proposals = proposals
        self._grants: dict[str, Grant] = {}
        self._answered: dict[str, asyncio.Event] = {}  # a held ask's wake-up, by approval
        self.pins = ToolPinStore(self)  # MCP tool descriptions pinned per server
        # what the watcher follows: record kind -> what to run when one was written
        self.watcher = RecordWatcher(store, {_GRANT: self._grants_written,
                                             _APPROVAL: self._wake,
                                             PIN_KIND: self.pins.refresh})

    async def start(self) -> None:
        """Load the grants and pins (they outlive restarts), then follow what is written
        anywhere (on the running loop)."""
        await self.refresh()
        await self.pins.refresh()
        self.watcher.start()

    # -- the gate's port (local view, no I/O) ----------------------------------------------

    def grant_for(self, sandbox: str, policy: str, request: Request,
                  model: str | None = None) -> Grant | None:
        now = self.clock()
        for grant in self._grants.values():
            if grant.covers(sandbox, policy, request, now, model):
                return grant
        return None

    def active(self, grant: str) -> bool:
        found = self._grants.get(grant)
        return found is not None and (found.expires is None or found.expires > self.clock())

    async def refresh(self) -> bool:
        """Reload the grants every process shares (the sweeper's cadence); True if they
        changed. A store that cannot answer keeps the last view."""
        try:
            docs = await self.store.record_list(_GRANT)
        except StateUnavailable as exc:
            log.warning("approvals: grants not refreshed: %s", exc)
            return False
        grants = {g.id: g for g in map(Grant.from_doc, docs) if g.expires is None
                  or g.expires > self.clock()}
        changed = grants.keys() != self._grants.keys()
        self._grants = grants
        return changed

    async def _grants_written(self) -> None:
        """A grant was written somewhere: load them, then let every held ask re-check."""
        await self.refresh()
        self._wake()

    def _wake(self) -> None:
        """Every ask held here reads its approval (and the grants) now."""
        for event in self._answered.values():
            event.set()

    # -- asking ----------------------------------------------------------------------------

    async def ask(self, identity: Identity, asked: Asked, reason: str, spec: Ask, *,
                  request: Request, model: str | None = None) -> Approval | Grant:
        """Hold `request` (naming `model`) until a person answers `asked`, or a grant
        written meanwhile, anywhere, covers it (returned)."""
        def covered() -> Grant | None:
            return self.grant_for(identity.sandbox, identity.policy, request, model)

        await self.refresh()  # (a grant another process wrote a moment ago: not asked)
        grant = covered()
        if grant is not None:
            return grant
        approval, opened = await self._open(identity, asked, reason, spec)
        if opened and self.webhooks is not None and spec.notify:
            self.webhooks.notify(spec.notify, approval)
        self.telemetry.gauge("approvals_pending", 1)
        started = self.clock()
        try:
            ended = await self._wait(approval, covered)
        finally:
            self.telemetry.gauge("approvals_pending", -1)
        self.telemetry.observe("approval_wait_seconds", self.clock() - started)
        return ended

    async def _open(self, identity: Identity, asked: Asked, reason: str, spec: Ask,
                    consent: dict[str, Any] | None = None, claim: str | None = None
                    ) -> tuple[Approval, bool]:
        """The pending approval for `claim` (default: this sandbox and thing) joined,
        or a new one."""
        claim = claim or f"{identity.sandbox}|{asked.key}"
        for _ in range(20):
            now = self.clock()
            held = await self.store.record_get(_CLAIM, claim)
            if held is not None:
                current = await self._read(str(held[0]["id"]))
                if current is not None and current[0].state == "pending":
                    return current[0], False
            waiting = sum(1 for d in await self.store.record_list(_APPROVAL)
                          if d.get("sandbox") == identity.sandbox
                          and d.get("state") == "pending" and d.get("expires", 0) > now)
            if waiting >= core.MAX_PENDING:
                self.telemetry.count("approvals", "limited")
                raise core.AskLimit(f"sandbox {identity.sandbox} already has {waiting} asks "
                                    "waiting for an answer")
            approval = Approval(id=core.new_id("ap"), sandbox=identity.sandbox,
                                policy=identity.policy, asked=asked, reason=reason[:500],
                                created=now, expires=now + spec.timeout, consent=consent)
            await self.store.record_put(_APPROVAL, approval.id, approval.to_doc(),
                                        approval.expires + self.retention, None)
            if await self.store.record_put(_CLAIM, claim, {"id": approval.id},
                                           approval.expires, None if held is None
                                           else held[1]):
                self.telemetry.count("approvals", "asked")
                self._line(approval, "ask", f"held for a person's answer: {reason}",
                           identity=identity)
                return approval, True
            # another process claimed it first: forget this one, join theirs
            await self.store.record_put(_APPROVAL, approval.id, approval.to_doc(), now, 1)
            await asyncio.sleep(0.01)
        raise StateUnavailable("approvals: the ask could not be recorded (contended)")

    async def _read(self, ident: str) -> tuple[Approval, int] | None:
        found = await self.store.record_get(_APPROVAL, ident)
        return None if found is None else (Approval.from_doc(found[0]), found[1])

    async def _wait(self, approval: Approval, covered: Callable[[], Grant | None] | None = None
                    ) -> Approval | Grant:
        event = self._answered.setdefault(approval.id, asyncio.Event())
        try:
            while True:
                event.clear()  # (a wake-up from here on is not lost: it sets it again)
                found = await self._read(approval.id)
                if found is None:
                    raise StateUnavailable(f"approval {approval.id} is no longer in the "
                                           "state store")
                current, rev = found
                if current.state != "pending":
                    return current
                grant = covered() if covered is not None else None
                if grant is not None:
                    await self._covered(current, rev, grant)
                    return grant
                now = self.clock()
                if now >= current.expires:
                    timed = replace(current, state="timeout", answered=now)
                    if await self.store.record_put(_APPROVAL, current.id, timed.to_doc(),
                                                   now + self.retention, rev):
                        self.telemetry.count("approvals", "timeout")
                        self._line(timed, "timeout", "no one answered within "
                                   f"{current.expires - current.created:g}s")
                        return timed
                    continue  # answered meanwhile: read it
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), min(POLL, current.expires - now))
        finally:
            if self._answered.get(approval.id) is event:
                del self._answered[approval.id]

    async def _covered(self, approval: Approval, rev: int, grant: Grant) -> None:
        """A grant made for something else covers a held request: its approval is
        closed as approved by that grant when the grant covers all it asks (else it
        stays for its other requests, or a person). Not the grant's own approval: its
        answerer writes the grant first and then the answer, and a close here in between
        would fail that answer's write (and expire the grant it had just made)."""
        if grant.approval == approval.id:
            return
        if not grant.asked.includes(approval.asked) or (
                grant.sandbox is not None and grant.sandbox != approval.sandbox) or \
                grant.policy != approval.policy:
            return
        now = self.clock()
        closed = replace(approval, state="approved", scope=grant.scope, by=grant.by,
                         note=f"covered by grant {grant.id}", answered=now, grant=grant.id)
        if await self.store.record_put(_APPROVAL, approval.id, closed.to_doc(),
                                       now + self.retention, rev):
            self.telemetry.count("approvals", "approved")
            self._line(closed, "approve", f"covered by grant {grant.id} ({grant.scope}, "
                       f"by {grant.by})", rule=grant.source)

    # -- answering (the admin API and the CLI) ---------------------------------------------

    async def answer(self, ident: str, decision: str, *, scope: str | None = None,
                     duration: object = None, by: str, note: str | None = None
                     ) -> tuple[Approval, Grant | None, Proposal | None]:
        """Answer approval `ident`; raises NotFound, or ValueError saying why the answer
        cannot be given (already answered, timed out, a bad scope or duration)."""
        found = await self._read(ident)
        if found is None:
            raise NotFound(ident)
        approval, rev = found
        now = self.clock()
        answered, grant = core.answer(approval, decision, scope=scope, duration=duration,
                                      by=by, note=note, now=now)
        tool = approval.asked.kind == "tool"
        if tool:  # (superseded by a later change, or answered: refused before it is recorded)
            await self.pins.check_open(approval)
        proposal = None
        if grant is not None:  # (live before anyone is told "approved")
            await self.store.record_put(_GRANT, grant.id, grant.to_doc(),
                                        grant.expires or now + FOREVER, None)
        if not await self.store.record_put(_APPROVAL, ident, answered.to_doc(),
                                           now + self.retention, rev):
            if grant is not None:
                await self._expire(grant)
            raise ValueError(f"approval {ident} was answered or timed out meanwhile")
        if tool:  # the pin follows (a failure here keeps the quarantine: fail closed)
            await self.pins.answered(answered)
        if grant is not None:
            self._grants[grant.id] = grant
            if grant.scope == "always":
                proposal = self._propose(grant)
        event = self._answered.get(ident)
        if event is not None:
            event.set()
        self.telemetry.count("approvals", answered.state)
        what = f"scope {answered.scope}" + (f", grant {grant.id}" if grant else "") \
            if answered.state == "approved" else "declined"
        self._line(answered, "approve" if answered.state == "approved" else "deny",
                   f"answered by {by}: {what}" + (f" ({note})" if note else ""),
                   rule=grant.source if grant else None)
        return answered, grant, proposal

    def _propose(self, grant: Grant) -> Proposal | None:
        """The policy change an `always` grant proposes (None: no directory to write it
        from); a failure is logged, the grant stands."""
        if self.policies is None or self.directory is None or self.proposals is None:
            return None
        policy = self.policies().get(grant.policy)
        if policy is None:
            return None
        try:
            return propose(self.directory, policy.source, grant, self.proposals)
        except OSError as exc:
            log.warning("approvals: no policy change written for grant %s: %s", grant.id, exc)
            return None

    async def revoke(self, ident: str, by: str) -> Grant:
        """End grant `ident` now, on every process (the sweeper closes what it opened)."""
        found = await self.store.record_get(_GRANT, ident)
        if found is None:
            raise NotFound(ident)
        grant = Grant.from_doc(found[0])
        await self._expire(grant)
        self._grants.pop(ident, None)
        self.telemetry.count("approvals", "revoked")
        self._line_grant(grant, by)
        return grant

    async def _expire(self, grant: Grant) -> None:
        for _ in range(5):
            found = await self.store.record_get(_GRANT, grant.id)
            if found is None or await self.store.record_put(
                    _GRANT, grant.id, found[0], self.clock(), found[1]):
                return
        raise StateUnavailable(f"grant {grant.id} could not be revoked (contended)")

    async def approvals(self) -> list[Approval]:
        """Pending first, then the most recent (one no one answered in time: `timeout`,
        whether or not a held request wrote it)."""
        now = self.clock()
        found = [Approval.from_doc(d).at(now)
                 for d in await self.store.record_list(_APPROVAL)]
        return sorted(found, key=lambda a: (a.state != "pending", -a.created))

    async def grants(self) -> list[Grant]:
        now = self.clock()
        found = [Grant.from_doc(d) for d in await self.store.record_list(_GRANT)]
        return sorted((g for g in found if g.expires is None or g.expires > now),
                      key=lambda g: -g.created)

    async def approval(self, ident: str) -> Approval:
        found = await self._read(ident)
        if found is None:
            raise NotFound(ident)
        return found[0].at(self.clock())

    # -- an MCP server's OAuth consent (`services/mcp_oauth`) ----------------------------

    async def open_consent(self, identity: Identity, asked: Asked, reason: str, spec: Ask,
                           consent: dict[str, Any], grant: str) -> tuple[Approval, bool]:
        """The pending consent approval for `grant` (the grant's key and the scopes
        asked: whichever sandbox, request or process asked it first) joined, or a new
        one carrying `consent` (its authorization URL); True if opened now (then
        audited and told to `spec`'s notifiers)."""
        approval, opened = await self._open(identity, asked, reason, spec, consent,
                                            claim=f"oauth|{grant}")
        if opened and self.webhooks is not None and spec.notify:
            self.webhooks.notify(spec.notify, approval)
        return approval, opened

    async def settled(self, ident: str) -> Approval:
        """Consent approval `ident` as it stands; pending past its expiry it is timed
        out here (recorded and audited once, whichever process or held request sees it
        first). Raises NotFound."""
        while True:
            found = await self._read(ident)
            if found is None:
                raise NotFound(ident)
            current, rev = found
            now = self.clock()
            if current.state != "pending" or now < current.expires:
                return current
            timed = replace(current, state="timeout", answered=now)
            if await self.store.record_put(_APPROVAL, ident, timed.to_doc(),
                                           now + self.retention, rev):
                self.telemetry.count("approvals", "timeout")
                self._line(timed, "timeout", "no one completed the consent within "
                           f"{current.expires - current.created:g}s")
                return timed

    async def consented(self, ident: str, by: str) -> Approval | None:
        """Close consent approval `ident` as approved (its authorization completed);
        None if it was no longer pending."""
        found = await self._read(ident)
        if found is None or found[0].state != "pending":
            return None
        now = self.clock()
        closed = replace(found[0], state="approved", scope="once", by=by, answered=now)
        if not await self.store.record_put(_APPROVAL, ident, closed.to_doc(),
                                           now + self.retention, found[1]):
            return None
        self.telemetry.count("approvals", "approved")
        self._line(closed, "approve", f"consent completed at the authorization server ({by})")
        event = self._answered.get(ident)
        if event is not None:
            event.set()
        return closed

    # -- asks without a held request (an MCP tool's change: `pins.py`) -----------------

    def opened(self, approval: Approval, identity: Identity) -> None:
        """An approval recorded without a request waiting on it: audited, counted, and
        told to the notifiers of the sandbox's policy's `ask:`."""
        self.telemetry.count("approvals", "asked")
        self._line(approval, "ask", f"held for a person's answer: {approval.reason}",
                   identity=identity)
        policy = self.policies().get(approval.policy) if self.policies else None
        notify = policy.ask.notify if policy is not None and policy.ask is not None else ()
        if self.webhooks is not None and notify:
            self.webhooks.notify(notify, approval)

    async def superseded(self, ident: str, by: str) -> None:
        """Close pending approval `ident`: what it asks about was replaced by `by`."""
        found = await self._read(ident)
        if found is None or found[0].state != "pending":
            return
        now = self.clock()
        closed = replace(found[0], state="denied", by="sandbox-gateway", answered=now,
                         note=f"superseded by {by}: the tool changed again")
        if await self.store.record_put(_APPROVAL, ident, closed.to_doc(),
                                       now + self.retention, found[1]):
            self._line(closed, "deny", f"superseded by approval {by}")

    async def close(self) -> None:
        await self.watcher.stop()
        await self.pins.close()
        if self.webhooks is not None:
            await self.webhooks.close()

    # -- audit -----------------------------------------------------------------------------

    def _line(self, approval: Approval, decision: str, reason: str, *,
              identity: Identity | None = None, rule: str | None = None) -> None:
        self.audit(approval_line(approval, decision, reason, self.clock(),
                                 identity=identity, rule=rule))

    def _line_grant(self, grant: Grant, by: str) -> None:
        self.audit(revoked_line(grant, by, self.clock()))
