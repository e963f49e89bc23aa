"""MCP tool pins in the state store (the core's `ToolPins` port; what a listing and an
answer do to a pin is `gateway/core/mcp_pins.py`).

Pins are shared records (kind ``mcp_pin``, one per server and tool, kept until deleted),
so every worker and replica checks listings against the same pins and they outlast a
restart. Listings are decided on a local view (no I/O on the response path): what a
listing changes — a first pin, a quarantine — holds in this process at once and is
written in the background by compare-and-set (two processes racing: one write wins, the
other re-decides on it); the view follows what other processes write through the
approvals' watcher (`RecordWatcher`, every 50 ms). A quarantine opens an approval of
kind ``tool`` (the old and the new text in its `change`), told to the notifiers of the
sandbox's policy's `ask:`; an answer updates the pin (`answered`): approving pins the
new text, denying keeps the quarantine. A write the store refuses leaves the quarantine
in this process (fail closed) and is tried again at the next listing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any, Protocol

from gateway.core import approvals as core
from gateway.core import mcp_pins
from gateway.core.approvals import Approval, Asked
from gateway.core.identity import Identity
from gateway.core.mcp_pins import KIND, Pin, Server, Shown
from gateway.services.state.base import Records, StateUnavailable

__all__ = ["FIRST", "Owner", "ToolPinStore"]

log = logging.getLogger("sandbox_gateway.approvals")

FIRST = "first listing"  # who pinned a tool's first text
KEEP = 100 * 365 * 86400.0  # how long a pin is kept: until deleted
_TRIES = 10  # compare-and-set attempts under contention


class Owner(Protocol):
    """What the pins use of the approvals service that owns them."""

    store: Records
    clock: Callable[[], float]
    retention: float

    def opened(self, approval: Approval, identity: Identity) -> None:
        """An approval recorded with no request waiting: audit, count, notify."""

    async def superseded(self, ident: str, by: str) -> None:
        """Close pending approval `ident`, replaced by approval `by`."""


class ToolPinStore:
    """See the module docstring; `approvals` owns it (its store, clock, audit, webhooks)."""

    def __init__(self, approvals: Owner) -> None:
        self.approvals = approvals
        self.store = approvals.store
        self._view: dict[str, Pin] = {}  # as the store has them
        self._local: dict[str, Pin] = {}  # decided here, not written yet
        self._writing: set[tuple[str, str]] = set()  # (key, fingerprint) being written
        self._tasks: set[asyncio.Task[None]] = set()

    # -- the port (local view, no I/O) -----------------------------------------------------

    def _pin(self, key: str) -> Pin | None:
        return self._local.get(key) or self._view.get(key)

    def quarantined(self, server: Server, tool: str) -> bool:
        pin = self._pin(server.key(tool))
        return pin is not None and pin.quarantined

    def listed(self, identity: Identity, server: Server, tool: str, shown: Shown) -> bool:
        key = server.key(tool)
        pin = self._pin(key)
        now = self.approvals.clock()
        show, action = mcp_pins.listed(pin, shown, now)
        if action == "pin":
            first = Pin(server, tool, shown, now, FIRST)
            self._local[key] = first
            self._spawn(key, shown, self._first(first, identity))
        elif action == "ask":
            assert pin is not None
            self._local[key] = mcp_pins.asked(pin, shown, None, now)
            self._spawn(key, shown, self._ask(key, identity, shown))
        elif action == "clear":
            assert pin is not None
            self._local[key] = replace(pin, change=None)
            self._spawn(key, shown, self._clear(key, shown))
        return show

    def _spawn(self, key: str, shown: Shown, work: Coroutine[Any, Any, None]) -> None:
        """Write in the background (once per key and text at a time)."""
        mark = (key, shown.fingerprint)
        if mark in self._writing:
            work.close()
            return
        self._writing.add(mark)

        async def run() -> None:
            try:
                await work
            except StateUnavailable as exc:
                log.warning("MCP tool pins: not written (%s); this process keeps the "
                            "quarantine, and tries again at the next listing", exc)
            except Exception:  # a bug must not leave the pin half-decided: logged
                log.exception("MCP tool pins: a write failed")
            finally:
                self._writing.discard(mark)

        task = asyncio.get_running_loop().create_task(run(), name="mcp-pin")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the view ------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Load every pin (at the start, and when the watcher says one was written)."""
        try:
            docs = await self.store.record_list(KIND)
        except StateUnavailable as exc:
            log.warning("MCP tool pins: not refreshed: %s", exc)
            return
        view: dict[str, Pin] = {}
        for doc in docs:
            try:
                pin = Pin.from_doc(doc)
            except (KeyError, TypeError, ValueError):
                log.warning("MCP tool pins: a malformed pin is ignored")
                continue
            view[pin.key] = pin
        self._view = view

    def _stored(self, pin: Pin) -> None:
        """`pin` is what the store holds now."""
        self._view[pin.key] = pin
        self._local.pop(pin.key, None)

    async def _read(self, key: str) -> tuple[Pin, int] | None:
        found = await self.store.record_get(KIND, key)
        return None if found is None else (Pin.from_doc(found[0]), found[1])

    async def _put(self, pin: Pin, rev: int | None) -> bool:
        return await self.store.record_put(KIND, pin.key, pin.to_doc(),
                                           self.approvals.clock() + KEEP, rev)

    # -- writes (background) ---------------------------------------------------------------

    async def _first(self, pin: Pin, identity: Identity) -> None:
        if await self._put(pin, None):
            self._stored(pin)
            return
        found = await self._read(pin.key)  # (another process pinned it first)
        if found is None:
            return
        self._stored(found[0])
        if mcp_pins.listed(found[0], pin.shown, self.approvals.clock())[1] == "ask":
            await self._ask(pin.key, identity, pin.shown)

    async def _clear(self, key: str, shown: Shown) -> None:
        for _ in range(_TRIES):
            found = await self._read(key)
            if found is None:
                return
            pin, rev = found
            if mcp_pins.listed(pin, shown, self.approvals.clock())[1] != "clear":
                self._stored(pin)
                return
            cleared = replace(pin, change=None)
            if await self._put(cleared, rev):
                self._stored(cleared)
                return
        raise StateUnavailable("the pin could not be written (contended)")

    async def _ask(self, key: str, identity: Identity, shown: Shown) -> None:
        """Quarantine the tool for `shown` and ask a person (one approval per change,
        whichever process saw it first)."""
        service = self.approvals
        for _ in range(_TRIES):
            found = await self._read(key)
            if found is None:
                return  # (no pin to compare with: the next listing pins it)
            pin, rev = found
            now = service.clock()
            if mcp_pins.listed(pin, shown, now)[1] != "ask":
                self._stored(pin)  # (asked already, by another process)
                return
            approval = self._approval(pin, shown, identity, now)
            await service.store.record_put("approval", approval.id, approval.to_doc(),
                                           approval.expires + service.retention, None)
            quarantined = mcp_pins.asked(pin, shown, approval.id, now)
            if not await self._put(quarantined, rev):
                await service.store.record_put("approval", approval.id, approval.to_doc(),
                                               now, 1)  # (forgotten: theirs stands)
                continue
            self._stored(quarantined)
            service.opened(approval, identity)
            old = pin.change
            if old is not None and old.state == "pending" and old.approval is not None:
                await service.superseded(old.approval, approval.id)
            return
        raise StateUnavailable("the pin could not be written (contended)")

    def _approval(self, pin: Pin, shown: Shown, identity: Identity, now: float) -> Approval:
        server = pin.server
        return Approval(
            id=core.new_id("ap"), sandbox=identity.sandbox, policy=identity.policy,
            asked=Asked("tool", server.host, server.port, path=server.path, tool=pin.tool),
            reason=f"the MCP server {server} lists tool {pin.tool[:200]!r} with another "
                   "description or input schema than the one pinned "
                   f"{'at its first listing' if pin.by == FIRST else f'by {pin.by}'} "
                   "(mcp.pin_descriptions): it is quarantined until a person approves",
            created=now, expires=now + mcp_pins.ASK_TIMEOUT,
            change={"server": str(server), "tool": pin.tool, "old": pin.shown.to_doc(),
                    "new": shown.to_doc()})

    # -- answers ---------------------------------------------------------------------------

    async def check_open(self, approval: Approval) -> None:
        """Raises ValueError unless `approval` is its tool's open change."""
        found = await self._read(_key(approval))
        if found is None:
            raise ValueError(f"approval {approval.id}: the tool's pin is gone")
        mcp_pins.deny(found[0], approval.id)  # (raises if not the open one)

    async def answered(self, approval: Approval) -> None:
        """Apply a person's answer to the pin: approved, the new text is pinned (the
        quarantine ends everywhere); denied, the quarantine stays."""
        key = _key(approval)
        for _ in range(_TRIES):
            found = await self._read(key)
            if found is None:
                raise ValueError(f"approval {approval.id}: the tool's pin is gone")
            pin, rev = found
            by = approval.by or "admin"
            updated = mcp_pins.approve(pin, approval.id, by, self.approvals.clock()) \
                if approval.state == "approved" else mcp_pins.deny(pin, approval.id)
            if await self._put(updated, rev):
                self._stored(updated)
                return
        raise StateUnavailable("the pin could not be written (contended)")

    async def close(self) -> None:
        """Let the background writes finish (bounded), then cancel what is left."""
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=2)
        for task in tasks:
            task.cancel()


def _key(approval: Approval) -> str:
    asked = approval.asked
    assert asked.kind == "tool" and asked.tool is not None and asked.path is not None
    return Server(asked.host, asked.port, asked.path).key(asked.tool)

