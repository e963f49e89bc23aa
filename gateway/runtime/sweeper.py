"""End open connections whose identity (or grant) no longer holds, on every worker.

Each request's identity is checked as it comes (`Gate.recheck`); a passthrough tunnel,
an idle keep-alive tunnel, a long stream or a WebSocket sends no more requests to check.
So every half second the gate looks over its open connections (`Gate.sweep`: the state
store's in-memory view, no I/O) and ends those whose token expired or was revoked, or
whose transparent sandbox is no longer registered: a revocation takes hold on every
engine and every worker within a second. Ask mode's grants are re-read from the state
store first, so a tunnel a revoked or expired grant opened ends the same way.
"""

from __future__ import annotations

from gateway.pipeline.gate import Gate
from gateway.services.approvals import ApprovalService
from gateway.services.polling import Poller

SWEEP_INTERVAL = 0.5  # seconds


class ConnectionSweeper(Poller):
    interval = SWEEP_INTERVAL
    _poll_name = "connection-sweeper"

    def __init__(self, gate: Gate, approvals: ApprovalService | None = None) -> None:
        self.gate = gate
        self.approvals = approvals

    async def check(self) -> bool:
        if self.approvals is not None:
            await self.approvals.refresh()
        return self.gate.sweep() > 0

    def start(self) -> None:
        self._poll()
