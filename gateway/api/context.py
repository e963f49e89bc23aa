"""What the admin listener (the admin API and the console) reads and changes."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from gateway.core.policy import PolicySet
from gateway.services.identity.issued import IssuedTokens
from gateway.services.identity.tokens import TokenService

if TYPE_CHECKING:
    from gateway.net.resolver import DestinationGuard
    from gateway.services.approvals import ApprovalService
    from gateway.services.identity.kubernetes import PodIdentities
    from gateway.services.mcp_oauth import McpOAuthService
    from gateway.services.metering import Metering
    from gateway.services.state.log import LogLines

__all__ = ["AdminContext", "Body", "Handler", "Readiness"]

Handler = Callable[[Request], Awaitable[Response]]  # a route's endpoint
Body = Callable[[Request], Awaitable[dict[str, Any]]]  # a request's JSON object (ValueError)


class Readiness(Protocol):
    def ready(self) -> tuple[bool, str]: ...

    def degraded(self) -> list[str]:
        """What serves on in a degraded way now (`/readyz` lists it), e.g. "state store"."""


@dataclass
class AdminContext:
    """What the admin API reads and changes."""

    admin_token: str
    tokens: TokenService
    policies: Callable[[], PolicySet]
    readiness: Readiness
    # The proxy's DestinationGuard, for `POST /v1/explain {"resolve": true}` (None: the
    # admin API cannot resolve, and says so).
    guard: Callable[[], DestinationGuard | None] | None = None
    metering: Metering | None = None
    clock: Callable[[], float] = time.time
    pods: PodIdentities | None = None  # identity.kubernetes (None: off)
    approvals: ApprovalService | None = None  # ask mode (None: no approvals here)
    request_log: LogLines | None = None  # the console's request log (None: console.retain 0)
    stopping: Callable[[], bool] = lambda: False  # the gateway stops: long answers end
    # console.trusted_proxies: peers whose X-Forwarded-* headers the console believes
    trusted_proxies: tuple[str, ...] = ("127.0.0.1", "::1")
    # The record of issued tokens (`identity/issued.py`), one per process: it holds what
    # the store could not take yet. None: one is made here (tests; no retries).
    issued_tokens: IssuedTokens | None = field(default=None)
    # The policies directory (the console's learn page reads the policy's file; None:
    # not known, the learned policy is shown without the file's diff)
    policies_dir: Path | None = None
    mcp_oauth: McpOAuthService | None = None  # MCP servers' OAuth client (None: off)

    @property
    def issued(self) -> IssuedTokens:
        if self.issued_tokens is None:
            self.issued_tokens = IssuedTokens(self.tokens.state,
                                              self.tokens.revocations.is_revoked)
        return self.issued_tokens
