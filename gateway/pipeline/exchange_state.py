"""What an exchange is: the request it carries, what was decided, what it recorded. The
parts that handle an exchange (`exchange.py`, `exchange_mcp.py`, `exchange_metering.py`,
`exchange_response.py`) share it; its audit line is written from it, once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.core import mcp
from gateway.core.addresses import Pinned
from gateway.core.archives import RATIO
from gateway.core.client import Client
from gateway.core.git_pack import PUSH_TYPE, is_push_path
from gateway.core.identity import Identity
from gateway.core.leaks import LeakScan
from gateway.core.messages import RequestHead, ResponseHead
from gateway.core.policy import Decision
from gateway.core.ports import Secrets
from gateway.core.refusal import Refusal
from gateway.core.target import Target
from gateway.core.trail import Trail
from gateway.core.unpack_bounds import AMPLE, Excess
from gateway.pipeline.exchange_content import ContentCapture
from gateway.pipeline.exchange_dlp import DlpCheck
from gateway.pipeline.exchange_oauth import OAuthUse

__all__ = ["ExchangeState", "leak_refusal", "source_of"]


@dataclass(eq=False)
class ExchangeState:
    """One admitted request/response (see `exchange.Exchange`): ``report`` what ``mode:
    report`` only recorded; ``mcp_calls`` and ``models`` the audit line's fields;
    ``unsent`` the request never reached the upstream (connect failed)."""

    trail: Trail
    secrets: Secrets
    client: Client
    identity: Identity
    head: RequestHead
    target: Target
    decision: Decision
    pinned: Pinned
    started: float
    scan: LeakScan | None = None
    credential: str | None = None
    response_head: ResponseHead | None = None
    bytes_out: int = 0
    bytes_in: int = 0
    done: bool = False
    report: Refusal | None = None
    mcp_calls: list[dict[str, Any]] | None = None
    models: list[str] | None = None
    unsent: bool = False
    dlp: DlpCheck | None = None  # outbound credential detection (a rule with dlp:)
    oauth: OAuthUse | None = None  # an MCP server's token the gateway holds (mcp.oauth)
    content: ContentCapture | None = None  # exported content (telemetry: {content: true})
    excess: Excess | None = None  # what its sandbox's data may unpack to (`unpacking`)
    # the gateway's span as its `traceparent` sent upstream (telemetry.propagate), and the
    # sandbox's own header it replaced
    trace_sent: str | None = None
    trace_arrived: str | None = None

    def __post_init__(self) -> None:
        """(What a subclass sets up after the fields: the dataclass calls it.)"""

    @property
    def trace(self) -> str | None:
        """The request's W3C ``traceparent`` as the sandbox sent it, for its audit lines
        (issue 45)."""
        if self.trace_sent is not None:
            return self.trace_arrived
        return self.head.headers.get("traceparent")

    @property
    def dlp_found(self) -> list[dict[str, Any]] | None:
        """What outbound detection found, for the audit line (None: no `dlp:` rule)."""
        return self.dlp.found if self.dlp is not None else None

    @property
    def body_type(self) -> str | None:
        """The Content-Type the request body is read by: its own, or a git push's on
        git's push path (`git_pack.is_push_path`)."""
        if is_push_path(self.target.path):
            return PUSH_TYPE
        return self.head.headers.get("content-type")

    def body_types(self) -> list[str]:
        """Every Content-Type a server may read the body by (its fields, and a git
        push's on git's push path)."""
        types = self.head.headers.get_all("content-type")
        return [*types, PUSH_TYPE] if is_push_path(self.target.path) else types

    def where(self) -> str:
        """``host:port`` of the upstream, as reasons name it."""
        return f"{self.target.host}:{self.target.port}"

    def leak(self, kind: str) -> Refusal:
        """The refusal of this request for carrying a key or token (`kind`), counted."""
        self.trail.telemetry.count("exfiltration_blocked", kind)
        return leak_refusal(kind, self.target.host)

    def note_calls(self, records: list[dict[str, Any]]) -> None:
        """MCP calls for the audit line (at most `mcp.MAX_AUDITED`)."""
        self.mcp_calls = ((self.mcp_calls or []) + records)[:mcp.MAX_AUDITED]

    def audit_message(self, refusal: Refusal,
                      calls: list[dict[str, Any]] | None = None) -> None:
        """One message of a WebSocket session refused: its own audit line (the session
        goes on, its line comes when it ends)."""
        self.trail.refuse(self.client, refusal, method=self.head.method,
                          scheme=self.target.scheme, host=self.target.host,
                          port=self.target.port, path=self.target.path,
                          started=self.trail.clock(), mcp=calls, trace=self.trace,
                          trace_sent=self.trace_sent,
                          dlp=self.dlp_found)


def source_of(decision: Decision) -> str | None:
    """The deciding rule's ``file:line`` (None: no rule)."""
    return decision.rule.source if decision.rule is not None else None


def leak_refusal(kind: str, host: str) -> Refusal:
    """The refusal of a request carrying a key or token (`kind`) to `host`; `unreadable`:
    one whose compressed run the leak guard could not read within its bound."""
    if kind == "unreadable":
        return Refusal("bad_request", "the request cannot be checked: a compressed file in "
                       f"it (in a base64 or hex run) unpacks to more than {RATIO} times its "
                       "size; send it uncompressed or in parts")
    if kind == "excess":  # (`pipeline/unpacking.py`)
        return Refusal("bad_request", "the request cannot be checked: this sandbox's "
                       f"compressed data unpacked to more than {AMPLE} times its size by "
                       "more than its limit lately (limits.unpacked_excess, refilled at "
                       "limits.unpacked_excess_rate a second); send it uncompressed, or slower")
    what = "a gateway token" if kind == "token" else \
        "a real API key (or a provider-minted secret, or its alias)"
    return Refusal("exfiltration_blocked", f"the request carries {what} to {host}, which "
                   "is not bound to it; keys and tokens go only to the hosts of their "
                   "credential (send the token only in the credential's own header, on a "
                   "rule with credential:)")
