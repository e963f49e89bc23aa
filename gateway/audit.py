"""The audit sink: where the core's audit records go (one JSON line each).

Records are built by `gateway.core.audit.record` (the same fields for every decision
on every engine); this module only writes them — to stdout by default, or appended to
`audit.path` — adding the worker index and the time, and counts them by policy,
decision and path.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from gateway import metrics


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
        now = time.time()
        record["time"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + (
            f".{int(now * 1000) % 1000:03d}Z")
        line = json.dumps(record, separators=(",", ":"), default=str)
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()
        metrics.child(metrics.REQUESTS, record.get("policy") or "-", record["decision"],
                      record.get("path_taken") or "-").inc()

    def close(self) -> None:
        if self._own:
            self._out.close()
