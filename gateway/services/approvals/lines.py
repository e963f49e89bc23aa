"""Ask mode's audit lines (no connection: `engine: approvals`): an approval opened
(`ask`), ended (`approve`, `deny`, `timeout`), and a grant revoked (`revoke`), each
naming the approval or the grant (`rule`), the sandbox and the policy."""

from __future__ import annotations

from typing import Any

from gateway.core.approvals import Approval, Grant
from gateway.core.audit import record
from gateway.core.identity import Identity

__all__ = ["approval_line", "revoked_line"]


def approval_line(approval: Approval, decision: str, reason: str, now: float, *,
                  identity: Identity | None = None, rule: str | None = None
                  ) -> dict[str, Any]:
    """The line of `approval` opened or ended (`decision`), `reason` after its id."""
    asked = approval.asked
    line = record(identity=identity, client=None, listener="admin",
                  method=asked.method or ("CONNECT" if asked.kind == "host" else None),
                  scheme=None, host=asked.host, port=asked.port, path=asked.path,
                  decision=decision, reason=f"approval {approval.id}: {reason}",
                  rule=rule or f"approval:{approval.id}", status=None, error=None,
                  bytes_in=None, bytes_out=None, started=now, path_taken=None,
                  engine="approvals")
    line["sandbox"], line["policy"] = approval.sandbox, approval.policy
    return line


def revoked_line(grant: Grant, by: str, now: float) -> dict[str, Any]:
    """The line of `grant` revoked by `by`."""
    asked = grant.asked
    line = record(identity=None, client=None, listener="admin", method=asked.method,
                  scheme=None, host=asked.host, port=asked.port, path=asked.path,
                  decision="revoke", reason=f"grant {grant.id} ({grant.scope}) revoked "
                  f"by {by}", rule=grant.source, status=None, error=None, bytes_in=None,
                  bytes_out=None, started=now, path_taken=None, engine="approvals")
    line["sandbox"], line["policy"] = grant.sandbox, grant.policy
    return line
