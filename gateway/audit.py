"""The audit trail: one JSON line per decision, and the request counter beside it.

A line holds who (sandbox, policy, token jti, client address), what (method, scheme,
host, port, path without its query string), the decision with its reason and rule,
the status, bytes and duration, and which path the traffic took (passthrough or
intercept). Never a token or a secret: query strings are dropped (they can carry
keys, e.g. Gemini's `?key=`), and reasons are built from fixed strings.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from mitmproxy import http

from gateway import metrics
from gateway.errors import Refusal
from gateway.policy import Decision
from gateway.tokens import Identity

MAX_PATH = 512


def _path_only(path: str) -> str:
    return path.split("?", 1)[0][:MAX_PATH]


class Auditor:
    """Writes audit lines to stdout or an append-only file."""

    def __init__(self, path: Path | None = None, stream: IO[str] | None = None,
                 worker: int | None = None) -> None:
        self._extra = {} if worker is None else {"worker": worker}
        if stream is not None:
            self._out = stream
        elif path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._out = path.open("a", encoding="utf-8", buffering=1)
        else:
            self._out = sys.stdout
        self._own = stream is None and path is not None
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        record.update(self._extra)
        record["time"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + (
            f".{int(time.time() * 1000) % 1000:03d}Z")
        line = json.dumps(record, separators=(",", ":"), default=str)
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()
        metrics.child(metrics.REQUESTS, record.get("policy") or "-", record["decision"],
                      record.get("path_taken") or "-").inc()

    def close(self) -> None:
        if self._own:
            self._out.close()

    # -- records -------------------------------------------------------------------------

    @staticmethod
    def _who(flow: http.HTTPFlow, identity: Identity | None) -> dict[str, Any]:
        peer = flow.client_conn.peername
        return {
            "sandbox": identity.sandbox if identity else None,
            "policy": identity.policy if identity else None,
            "jti": identity.jti if identity else None,
            "client": f"{peer[0]}:{peer[1]}" if peer else None,
        }

    @staticmethod
    def _what(flow: http.HTTPFlow, host: str | None = None, port: int | None = None
              ) -> dict[str, Any]:
        req = flow.request
        connect = req.method == "CONNECT"
        return {
            "method": req.method,
            "scheme": None if connect else req.scheme,
            "host": host or req.host,
            "port": port or req.port,
            "path": None if connect else _path_only(req.path),
        }

    def refused(self, flow: http.HTTPFlow, refusal: Refusal, identity: Identity | None,
                host: str | None = None, port: int | None = None) -> None:
        self.write({
            **self._who(flow, identity), **self._what(flow, host, port),
            "decision": "deny", "error": refusal.code, "reason": refusal.reason,
            "rule": refusal.rule, "status": refusal.status, "bytes_in": 0, "bytes_out": 0,
            "duration_ms": _ms(flow.request.timestamp_start), "path_taken": None,
        })

    def completed(self, flow: http.HTTPFlow, identity: Identity | None, decision: str,
                  reason: str, rule: str | None, host: str, port: int, bytes_in: int,
                  path_taken: str, credential: str | None) -> None:
        status = flow.response.status_code if flow.response else None
        error = flow.error.msg if flow.error else None
        self.write({
            **self._who(flow, identity), **self._what(flow, host, port),
            "decision": decision, "reason": reason, "rule": rule, "status": status,
            "error": "upstream_failed" if error and status is None else None,
            "bytes_in": bytes_in,
            "bytes_out": len(flow.request.raw_content or b""),
            "duration_ms": _ms(flow.request.timestamp_start),
            "path_taken": path_taken, "credential": credential,
        })

    def tunnel(self, flow_like: dict[str, Any]) -> None:
        """A line for a connection that is not an HTTP flow (a refused transparent one)."""
        self.write(flow_like)

    def passthrough_closed(self, identity: Identity | None, decision: Decision,
                           client: tuple[str, int] | None, host: str, port: int,
                           started: float, bytes_in: int | None,
                           bytes_out: int | None) -> None:
        """A passthrough tunnel ended: one line for its CONNECT decision and traffic."""
        self.write({
            "sandbox": identity.sandbox if identity else None,
            "policy": identity.policy if identity else None,
            "jti": identity.jti if identity else None,
            "client": f"{client[0]}:{client[1]}" if client else None,
            "method": "CONNECT", "scheme": None, "host": host, "port": port, "path": None,
            "decision": decision.result, "reason": decision.reason,
            "rule": decision.rule.source if decision.rule else None, "status": 200,
            "bytes_in": bytes_in, "bytes_out": bytes_out,
            "duration_ms": round((time.time() - started) * 1000, 3),
            "path_taken": "passthrough",
        })


def _ms(start: float | None) -> float | None:
    return None if start is None else round((time.time() - start) * 1000, 3)
