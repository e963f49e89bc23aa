"""What the metering step hands out and takes back: the admitted `Exchange` (the body to
forward, the meter of the response, the budget hold) and what it `Metered` (the audit
line's ``usage``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.core.metering.endpoints import Endpoint
from gateway.core.metering.usage import RESPONSE_HOLD, Meter, Usage
from gateway.core.policy.compiled import Policy
from gateway.core.policy.model import Rule
from gateway.services.metering.budgets import Hold

__all__ = ["NOT_METERED", "Exchange", "Metered", "Pending"]


@dataclass(slots=True)
class Pending:
    """A ``response.create`` of a WebSocket session that holds a reservation."""

    hold: Hold
    started: bool = False
    event_id: str | None = None  # the client's event_id (a Realtime error names it)
    response_id: str | None = None  # the provider's, from its response.created


@dataclass(slots=True)
class Exchange:
    """An admitted exchange: ``body`` is the request body to forward instead of the
    original (None = unchanged; update Content-Length), ``feed`` takes response chunks."""

    sandbox: str
    policy: Policy
    credential: str
    body: bytes | None
    meter: Meter | None
    rule: Rule | None = None
    endpoint: Endpoint | None = None
    hold: Hold | None = None
    required: bool = False
    deferred: str | None = None  # the kind of job whose id the answer names
    retrieval: str | None = None  # the pending job whose usage this answer may carry
    holds_response: bool = False  # a provider-minted secret: read before it is relayed
    capture: list[bytes] | None = None
    pending: dict[str | None, list[Pending]] | None = None  # (a session's, by lane)
    unread: dict[str | None, int] | None = None  # (by lane: responses ended unread)

    def head(self, header: Callable[[str], str | None]) -> None:
        """The response's headers (``header(name)``: a field's value, or None)."""
        if self.meter is not None:
            self.meter.head(header)

    def feed(self, chunk: bytes) -> None:
        """One decoded response body chunk, as relayed."""
        if self.meter is not None:
            self.meter.feed(chunk)
        if self.capture is not None and sum(map(len, self.capture)) < RESPONSE_HOLD:
            self.capture.append(bytes(chunk))


@dataclass(frozen=True, slots=True)
class Metered:
    """What an exchange used (``usage`` None: not an inference call), its cost, and
    what budgets counted: ``reserved`` while it ran, ``charged`` (tokens) when it ended,
    on ``basis`` "usage" or "reservation" (its usage never arrived)."""

    usage: Usage | None
    cost_usd: float | None
    reserved: int | None = None
    charged: int | None = None
    basis: str | None = None

    def as_record(self) -> dict[str, Any] | None:
        """The audit line's ``usage`` object (None for a non-inference request)."""
        if self.usage is None:
            return None
        record = self.usage.as_record()
        record["cost_usd"] = self.cost_usd
        if self.reserved is not None:
            record["budget"] = {"reserved_tokens": self.reserved,
                                "charged_tokens": self.charged, "basis": self.basis}
        return record


NOT_METERED = Metered(None, None)
