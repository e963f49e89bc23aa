"""The audit record: one builder, the same fields for every decision on every engine.

Allow, report and deny lines carry the same keys (a value the decision did not reach
is null), so a query over the audit trail never has to know which engine or which
step wrote a line. Never a token or a secret: the path loses its query string (it can
carry keys, e.g. Gemini's `?key=`), and reasons are built from fixed sentences.
"""

from __future__ import annotations

import re
import time
from typing import Any

from gateway.core.identity import Identity

__all__ = ["FIELDS", "MAX_PATH", "child_traceparent", "record", "traceparent"]

MAX_PATH = 512
FIELDS = ("sandbox", "policy", "jti", "client", "listener", "method", "scheme", "host",
          "port", "path", "decision", "reason", "rule", "status", "error", "bytes_in",
          "bytes_out", "duration_ms", "path_taken", "engine", "credential", "policy_rev",
          "usage", "workload", "mcp", "models", "trace", "trace_sent", "dlp")
# W3C Trace Context, version 00 (or a later version read as 00): trace id, parent id, flags;
# all-zero ids are invalid.
_TRACEPARENT = re.compile(r"(?!ff)[0-9a-f]{2}-(?!0{32})([0-9a-f]{32})-(?!0{16})([0-9a-f]{16})"
                          r"-[0-9a-f]{2}(-.*)?")


def traceparent(value: str | None) -> str | None:
    """The `traceparent` header of a request as its audit line's ``trace`` (the sandbox's
    W3C trace, continued by the gateway's span: gateway/observability/otel.py), or None
    for none or one that is not a valid traceparent (never arbitrary header text)."""
    if value is None or len(value) > 256:
        return None
    found = _TRACEPARENT.fullmatch(value.strip())
    if found is None or (found.group(3) is not None and value.strip()[:2] == "00"):
        return None
    return value.strip()[:55]


def child_traceparent(trace: str | None, trace_id: str, span_id: str) -> str:
    """The `traceparent` the gateway sends upstream where it propagates its trace
    (`telemetry.propagate`): its own span (`span_id`, 16 hex digits) as the parent, in
    the sandbox's trace (`trace`: its checked header, see `traceparent`) or else in a new
    one (`trace_id`, 32 hex digits); sampled (the gateway exports that span)."""
    if trace is not None:
        trace_id = trace[3:35]
    return f"00-{trace_id}-{span_id}-01"


def _path_only(path: str | None) -> str | None:
    return None if path is None else path.split("?", 1)[0][:MAX_PATH]


def record(*, identity: Identity | None, client: tuple[str, int] | None, listener: str,
           method: str | None, scheme: str | None, host: str | None, port: int | None,
           path: str | None, decision: str, reason: str, rule: str | None,
           status: int | None, error: str | None, bytes_in: int | None,
           bytes_out: int | None, started: float, path_taken: str | None, engine: str,
           credential: str | None = None, policy_rev: str | None = None,
           usage: dict[str, Any] | None = None, now: float | None = None,
           mcp: list[dict[str, Any]] | None = None,
           models: list[str] | None = None, trace: str | None = None,
           dlp: list[dict[str, Any]] | None = None,
           trace_sent: str | None = None) -> dict[str, Any]:
    """One audit line (a dict with exactly FIELDS, in that order). ``dlp``: the
    credentials outbound detection found (`core/dlp/verdict.records`: detector, where,
    salted fingerprint, action), never their values; null where none was found."""
    end = time.time() if now is None else now
    return {
        "sandbox": identity.sandbox if identity else None,
        "policy": identity.policy if identity else None,
        "jti": identity.jti if identity else None,
        "client": f"{client[0]}:{client[1]}" if client else None,
        "listener": listener,
        "method": method,
        "scheme": scheme,
        "host": host,
        "port": port,
        "path": _path_only(path),
        "decision": decision,
        "reason": reason,
        "rule": rule,
        "status": status,
        "error": error,
        "bytes_in": bytes_in,
        "bytes_out": bytes_out,
        "duration_ms": round((end - started) * 1000, 3),
        "path_taken": path_taken,
        "engine": engine,
        "credential": credential,
        "policy_rev": policy_rev,
        "usage": usage,
        "workload": identity.workload.fields() if identity and identity.workload else None,
        "mcp": mcp,
        "models": models,
        "trace": trace,
        "trace_sent": trace_sent,
        "dlp": dlp,
    }
