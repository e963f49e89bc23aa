"""MCP tool descriptions pinned per server, the pure part: what a listing of a tool does
to its pin, and what a person's answer makes of it (no I/O; the pins live in the state
store, `gateway/services/approvals/pins.py`, shared by every worker and replica and kept
across restarts).

A rule with `mcp: {pin_descriptions: true}` pins each tool of its server (`Server`:
host, port and path) the first time a listing shows it: its description and input
schema (`Shown`, by fingerprint). Every later listing, in any session, on any process,
is checked against the pin (`listed`):

* the pinned text: shown;
* another text: the tool is **quarantined** — left out of the list, its calls refused
  (`mcp_tool_changed`) — and a person is asked (an approval of kind ``tool``, showing
  the old and the new text). Approving pins the new text and ends the quarantine
  (`approve`); denying keeps it (`deny`) while the server lists that text;
* while a change waits for its answer the tool stays quarantined whatever the server
  lists; after a denial, a listing of the pinned text again ends the quarantine (the
  server is back to what was approved: `clear`), a third text is asked about anew (the
  earlier ask superseded); an ask no one answered in `ASK_TIMEOUT` is asked again at the
  next listing of that text.

A tool no listing showed yet has no pin: its calls are decided by the rule alone.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

from gateway.core.identity import Identity
from gateway.core.mcp import fingerprint

__all__ = ["ASK_TIMEOUT", "KIND", "TEXT_MAX", "Action", "Change", "Pin", "Server",
           "ServerPins", "Shown", "ToolPins", "approve", "asked", "deny", "listed"]

KIND = "mcp_pin"  # the state store's record kind
TEXT_MAX = 8000  # characters of a description or schema kept to show people
ASK_TIMEOUT = 86400.0  # seconds a tool's change waits for an answer (then asked again)

Action = Literal["none", "pin", "ask", "clear"]


@dataclass(frozen=True, slots=True)
class Server:
    """An MCP server as pins key it: the host, port and path its calls are POSTed to
    (the query left out)."""

    host: str
    port: int
    path: str

    def __str__(self) -> str:
        return f"{self.host}:{self.port}{self.path}"

    def key(self, tool: str) -> str:
        """The state store's key of `tool`'s pin on this server."""
        return hashlib.sha256(f"{self}\n{tool}".encode()).hexdigest()


def _clipped(text: str) -> str:
    if len(text) <= TEXT_MAX:
        return text
    return f"{text[:TEXT_MAX]}… ({len(text) - TEXT_MAX} more characters)"


@dataclass(frozen=True, slots=True)
class Shown:
    """A tool as a listing shows it: the fingerprint of its description and input schema
    (the whole of both), and the two as people are shown them (clipped)."""

    fingerprint: str
    description: str | None
    schema: str  # the input schema as JSON

    @classmethod
    def of(cls, tool: dict[str, Any]) -> Shown:
        description = tool.get("description")
        text = description if isinstance(description, str) else (
            None if description is None else json.dumps(description))
        return cls(fingerprint(tool), None if text is None else _clipped(text),
                   _clipped(json.dumps(tool.get("inputSchema"), sort_keys=True)))

    def to_doc(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "description": self.description,
                "inputSchema": self.schema}

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Shown:
        return cls(str(doc["fingerprint"]), doc.get("description"), str(doc["inputSchema"]))


@dataclass(frozen=True, slots=True)
class Change:
    """A text other than the pinned one, seen at `seen`: ``pending`` a person's answer
    (`approval`, None until the ask is recorded; unanswered by `expires`, asked again),
    or ``denied``."""

    shown: Shown
    seen: float
    state: Literal["pending", "denied"]
    approval: str | None
    expires: float

    def to_doc(self) -> dict[str, Any]:
        return {"shown": self.shown.to_doc(), "seen": self.seen, "state": self.state,
                "approval": self.approval, "expires": self.expires}

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Change:
        return cls(Shown.from_doc(doc["shown"]), float(doc["seen"]), doc["state"],
                   doc.get("approval"), float(doc["expires"]))


@dataclass(frozen=True, slots=True)
class Pin:
    """`tool` of `server` as approved: pinned at `pinned` by `by` (``first listing``, or
    the person who approved a change); `change` a text no one approved (quarantined)."""

    server: Server
    tool: str
    shown: Shown
    pinned: float
    by: str
    change: Change | None = None

    @property
    def key(self) -> str:
        return self.server.key(self.tool)

    @property
    def quarantined(self) -> bool:
        """Its calls are refused, its listings hidden (a change no one approved)."""
        return self.change is not None

    def to_doc(self) -> dict[str, Any]:
        return {"host": self.server.host, "port": self.server.port,
                "path": self.server.path, "tool": self.tool, "shown": self.shown.to_doc(),
                "pinned": self.pinned, "by": self.by,
                "change": None if self.change is None else self.change.to_doc()}

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Pin:
        change = doc.get("change")
        return cls(Server(str(doc["host"]), int(doc["port"]), str(doc["path"])),
                   str(doc["tool"]), Shown.from_doc(doc["shown"]), float(doc["pinned"]),
                   str(doc["by"]), None if change is None else Change.from_doc(change))


def listed(pin: Pin | None, shown: Shown, now: float) -> tuple[bool, Action]:
    """A listing shows the tool as `shown`: is it shown to the agent, and what is written
    (``pin`` it, ``ask`` a person about the change, ``clear`` a denied change)?"""
    if pin is None:
        return True, "pin"  # (first seen: pinned as it is)
    change = pin.change
    if shown.fingerprint == pin.shown.fingerprint:
        if change is None:
            return True, "none"
        if change.state == "denied":
            return True, "clear"  # (back to the approved text)
        return False, "none"  # (a person has yet to answer)
    if change is not None and change.shown.fingerprint == shown.fingerprint:
        if change.state == "pending" and (change.approval is None or now >= change.expires):
            return False, "ask"  # (never recorded, or unanswered: asked again)
        return False, "none"
    return False, "ask"


def asked(pin: Pin, shown: Shown, approval: str | None, now: float) -> Pin:
    """`pin` quarantined for `shown`, waiting on `approval`."""
    return replace(pin, change=Change(shown, now, "pending", approval, now + ASK_TIMEOUT))


def _open(pin: Pin, approval: str) -> Change:
    change = pin.change
    if change is None or change.approval != approval:
        now = f" (the open one is {change.approval})" if change and change.approval else ""
        raise ValueError(f"approval {approval} is no longer the open change of tool "
                         f"{pin.tool!r} on {pin.server}: the server changed it again or "
                         f"it was answered{now}")
    return change


def approve(pin: Pin, approval: str, by: str, now: float) -> Pin:
    """The change `approval` asked about, pinned (the quarantine ends). Raises
    ValueError if it is not the tool's open change."""
    change = _open(pin, approval)
    return replace(pin, shown=change.shown, pinned=now, by=by, change=None)


def deny(pin: Pin, approval: str) -> Pin:
    """The change declined: the tool stays quarantined while the server lists it.
    Raises ValueError if it is not the tool's open change."""
    return replace(pin, change=replace(_open(pin, approval), state="denied"))


class ToolPins(Protocol):
    """The pins (the port: `gateway/services/approvals/pins.py`): a local view, no I/O;
    what a listing changes is written to the state store in the background."""

    def listed(self, identity: Identity, server: Server, tool: str, shown: Shown) -> bool:
        """Show `tool` as the server lists it now (`shown`) to `identity`'s agent?"""
        ...

    def quarantined(self, server: Server, tool: str) -> bool: ...


@dataclass(slots=True)
class ServerPins:
    """One exchange's view of its server's pins, as the MCP checks read them: a tool
    `in` it is quarantined (its calls refused), `shown` decides a listed tool. On the
    older HTTP+SSE transport the GET stream's `endpoint` event names the path calls are
    POSTed to: the stream's listings are pinned under that path."""

    pins: ToolPins
    identity: Identity
    server: Server

    def __contains__(self, tool: object) -> bool:
        return isinstance(tool, str) and self.pins.quarantined(self.server, tool)

    def shown(self, tool: str, listing: dict[str, Any]) -> bool:
        return self.pins.listed(self.identity, self.server, tool, Shown.of(listing))

    def endpoint(self, uri: str) -> None:
        path = urlsplit(uri.strip()).path
        if path.startswith("/"):
            self.server = replace(self.server, path=path)
