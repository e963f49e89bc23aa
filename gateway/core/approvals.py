"""Ask mode, the pure part: what a held request asks a person for, the answer they give,
and the grants an answer leaves behind (no I/O; the approvals service stores, shares
and waits, the gate decides when to ask).

A request no rule allows is *askable* when its policy's `ask:` says so (`hosts`: a host
no rule names; `requests`: a method or path on a host some rule names), or when the rule
that matches it says `ask:` (it goes only once approved). What is asked (`Asked`) is
a host and port (at CONNECT, or a host no rule names), or one method and path on it
(query ignored). Destination checks and credential binding are never asked: the gate
asks only about a policy's `deny`, after the destination check has passed.

An answer approves or denies, with a scope: `once` (the requests held on this approval
proceed; nothing is kept), `sandbox` or `policy` for a duration (a `Grant` that lets the
same thing through for that sandbox, or every sandbox of the policy, until it expires or
is revoked), or `always` (a policy grant without expiry, plus a policy change proposed
for review). A grant stands in for a rule: decisions it allows name `grant:<id>`.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, Self

from gateway.core.durations import parse_duration
from gateway.core.policy import Request

__all__ = ["DEFAULT_DURATION", "MAX_PENDING", "SCOPES", "Approval", "AskLimit", "Asked",
           "Grant", "answer", "asked_for", "new_id"]

Kind = Literal["host", "request", "model", "tool", "oauth"]
State = Literal["pending", "approved", "denied", "timeout"]
SCOPES = ("once", "sandbox", "policy", "always")
DEFAULT_DURATION = 3600.0  # a sandbox or policy grant with no duration given: an hour
MAX_DURATION = 90 * 86400.0  # longer than this is what `always` (reviewed) is for
_NOTE_MAX = 500
MAX_PENDING = 16  # asks one sandbox may have waiting at once (more are refused, not asked)


class AskLimit(Exception):
    """The sandbox already has `MAX_PENDING` asks waiting: this one is not asked."""


def new_id(prefix: str) -> str:
    """A fresh, unguessable id (`ap_…` approvals, `gr_…` grants)."""
    return f"{prefix}_{secrets.token_hex(8)}"


@dataclass(frozen=True, slots=True)
class Asked:
    """What a held request asks for: `host` on `port` (kind ``host``: the host, any
    request), one `method` and `path` (no query) on it (kind ``request``), or a `model`
    its rule's allowlist refuses, on that host (kind ``model``). Kind ``tool``: an MCP
    server's (`host`, `port`, `path`) `tool` changed its description or input schema
    (its approval carries the texts; approving pins the new one, `core/mcp_pins.py`).
    Kind ``oauth``: a person's OAuth consent to the MCP server at (`host`, `port`,
    `path`) (its approval carries the authorization URL in `consent`; it is answered by
    completing that URL, `services/mcp_oauth`, or declined)."""

    kind: Kind
    host: str
    port: int
    method: str | None = None
    path: str | None = None
    model: str | None = None
    tool: str | None = None

    @property
    def key(self) -> str:
        """The same thing asked twice has the same key (one approval for both)."""
        return "|".join([self.kind, self.host, str(self.port), self.method or "",
                         self.path or "", self.model or "", self.tool or ""])

    def describe(self) -> str:
        """One line for people: ``api.example.com:443 (any request)``, ``GET
        api.example.com:443/v1/x``, ``model gpt-5 on api.openai.com:443`` or ``tool
        search changed on mcp.example.com:443/mcp``."""
        if self.kind == "host":
            return f"{self.host}:{self.port} (any request)"
        if self.kind == "model":
            return f"model {self.model} on {self.host}:{self.port}"
        if self.kind == "tool":
            return f"tool {self.tool} changed on {self.host}:{self.port}{self.path}"
        if self.kind == "oauth":
            return f"OAuth consent for the MCP server {self.host}:{self.port}{self.path}"
        return f"{self.method} {self.host}:{self.port}{self.path}"

    def covers(self, request: Request, model: str | None = None) -> bool:
        """Does approving this let `request` (naming `model`) through? A host: a tunnel
        or any request to it; a request: that method and path (any query); a model:
        requests on the host naming that model (only: the rest of the allowlist stands);
        a tool's change: no request (it updates the tool's pin)."""
        if request.host != self.host or request.port != self.port or \
                self.kind in ("tool", "oauth"):
            return False
        if self.kind == "host":
            return True
        if self.kind == "model":
            return model is not None and model == self.model
        return (request.method == self.method and request.path is not None
                and request.path.split("?", 1)[0] == self.path)

    def includes(self, other: Asked) -> bool:
        """Does approving this let through every request approving `other` would?"""
        if {other.kind, self.kind} & {"tool", "oauth"} or \
                (other.host, other.port) != (self.host, self.port):
            return False
        if self.kind == "host":
            return True
        return self.kind == other.kind and (self.method, self.path, self.model) == \
            (other.method, other.path, other.model)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Asked:
        return cls(kind=doc["kind"], host=doc["host"], port=int(doc["port"]),
                   method=doc.get("method"), path=doc.get("path"), model=doc.get("model"),
                   tool=doc.get("tool"))


def asked_for(request: Request, host_known: bool) -> Asked:
    """What to ask for `request` that the policy refused: its host (at CONNECT, or a
    host no rule names: `host_known` False), else its method and path."""
    if request.method is None or not host_known:
        return Asked("host", request.host, request.port)
    return Asked("request", request.host, request.port, request.method,
                 (request.path or "/").split("?", 1)[0])


class _Stored:
    """A record the state store keeps as JSON (an `asked` within)."""

    __slots__ = ()

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload, no-any-return]

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Self:
        return cls(**{**doc, "asked": Asked.from_doc(doc["asked"])})


@dataclass(frozen=True, slots=True)
class Approval(_Stored):
    """One ask: who asked (`sandbox`, `policy`), for what, why the policy said no
    (`reason`), until when it waits (`expires`); once answered, the answer (`state`,
    `scope`, `by`, `note`, `answered`) and the grant it made, if any."""

    id: str
    sandbox: str
    policy: str
    asked: Asked
    reason: str
    created: float
    expires: float
    state: State = "pending"
    scope: str | None = None
    duration: float | None = None
    by: str | None = None
    note: str | None = None
    answered: float | None = None
    grant: str | None = None
    change: dict[str, Any] | None = None  # kind tool: {"old": …, "new": …} (`mcp_pins`)
    consent: dict[str, Any] | None = None  # kind oauth: {"url": …, "resource": …, …}

    def at(self, now: float) -> Approval:
        """This approval as it stands at `now`: pending past its expiry is timed out
        (whether or not a held request recorded it)."""
        if self.state == "pending" and now >= self.expires:
            return replace(self, state="timeout")
        return self


@dataclass(frozen=True, slots=True)
class Grant(_Stored):
    """What an approval lets through beyond the policy: `asked`, for `sandbox` (scope
    ``sandbox``) or every sandbox of `policy`, until `expires` (None: until revoked)."""

    id: str
    approval: str
    scope: str
    policy: str
    sandbox: str | None
    asked: Asked
    by: str
    note: str | None
    created: float
    expires: float | None

    def covers(self, sandbox: str, policy: str, request: Request, now: float,
               model: str | None = None) -> bool:
        if self.expires is not None and now >= self.expires:
            return False
        if self.policy != policy or (self.sandbox is not None and self.sandbox != sandbox):
            return False
        return self.asked.covers(request, model)

    def describe(self) -> str:
        """Who let it through, for whom and until when (an allowed line's reason)."""
        until = "until revoked" if self.expires is None else "until " + time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.expires))
        who = f"sandbox {self.sandbox}" if self.sandbox else f"policy {self.policy}"
        return f"granted by {self.by} ({self.scope}: {who}, {until})"

    @property
    def source(self) -> str:
        """How decisions it allows name their rule (`rule` on the audit line)."""
        return f"grant:{self.id}"



def answer(approval: Approval, decision: str, *, scope: str | None = None,
           duration: object = None, by: str, note: str | None = None,
           now: float) -> tuple[Approval, Grant | None]:
    """The approval answered (`approve` or `deny`) and the grant it makes (scopes
    ``sandbox``, ``policy``, ``always``). Raises ValueError, in words for the person
    answering, for an answer that cannot be given (not pending, a bad scope or
    duration)."""
    if approval.state != "pending":
        raise ValueError(f"approval {approval.id} was already answered ({approval.state})")
    if now >= approval.expires:
        raise ValueError(f"approval {approval.id} timed out before it was answered")
    if decision not in ("approve", "deny"):
        raise ValueError("decision must be approve or deny")
    if not by or len(by) > 200:
        raise ValueError("say who answers (by: 1-200 characters)")
    if note is not None and len(note) > _NOTE_MAX:
        raise ValueError(f"a note is at most {_NOTE_MAX} characters")
    if decision == "deny":
        return replace(approval, state="denied", by=by, note=note, answered=now), None
    if approval.asked.kind == "oauth":
        raise ValueError("an OAuth consent is given by opening its authorization URL "
                         "(consent.url) and signing in; here it can only be declined")
    if approval.asked.kind == "tool" and (scope not in (None, "once") or
                                          duration is not None):
        raise ValueError("a tool's change is approved for its server (the new text is "
                         "pinned): it takes no scope or duration")
    scope = scope or "once"
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}")
    seconds: float | None = None
    if scope in ("sandbox", "policy"):
        seconds = DEFAULT_DURATION if duration is None else parse_duration(duration)
        if seconds > MAX_DURATION:
            raise ValueError("a grant lasts at most 90d; use scope always to propose a "
                             "policy change for review")
    elif duration is not None:
        raise ValueError(f"scope {scope} takes no duration")
    grant = None
    if scope != "once":
        grant = Grant(id=new_id("gr"), approval=approval.id, scope=scope,
                      policy=approval.policy,
                      sandbox=approval.sandbox if scope == "sandbox" else None,
                      asked=approval.asked, by=by, note=note, created=now,
                      expires=None if seconds is None else now + seconds)
    answered = replace(approval, state="approved", scope=scope, duration=seconds, by=by,
                       note=note, answered=now, grant=grant.id if grant else None)
    return answered, grant
