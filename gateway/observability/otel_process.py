"""The worker's OpenTelemetry exporter process: started with the worker when
`telemetry.endpoint` is set, restarted when it exits (with backoff), stopped with it.

One exporter per worker (`python -m gateway.observability.otel_export`, the OpenTelemetry
SDK imported there only): it scales with the workers, and a worker restarted by the
supervisor (`runtime/watch.py`) starts its own again. The two talk over a unix
SOCK_SEQPACKET socketpair: the first datagram carries the exporter's settings (the
collector's headers among them, so never in argv), then the worker's frames
(`otel_feed.py`). The exporter ends at the end of that socket, so it never outlives its
worker, however the worker ends. On the way back the exporter reports what it dropped
(`otel_export.Reporter`: totals since it started), which the worker reads every WATCH
seconds into `sandbox_gateway_telemetry_export_dropped_total` (its /metrics, summed
over the workers by the multiprocess directory like every counter).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import time
from typing import Any

from gateway.observability import metrics
from gateway.observability.otel_feed import SNDBUF, OtelFeed

__all__ = ["BACKOFF", "ExporterProcess"]

log = logging.getLogger("sandbox_gateway")

BACKOFF = (1.0, 30.0)  # first and longest wait before a restart (doubling while it fails)
STABLE = 10.0  # an exporter that ran this long before exiting restarts after the first wait
WATCH = 1.0  # seconds between looks at the exporter


class ExporterProcess:
    """Starts, watches and stops the exporter process that `feed` sends to."""

    def __init__(self, settings: dict[str, Any], feed: OtelFeed) -> None:
        self.settings = settings
        self.feed = feed
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._started = 0.0
        self._wait = BACKOFF[0]
        self._due: float | None = None  # a restart's time (monotonic)
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._reported: dict[str, int] = {}  # the current exporter's drop totals counted

    def start(self) -> None:
        """Spawn the exporter and attach the feed to it (raises OSError if it cannot)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway.observability.otel_export",
                 str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL)
            ours.sendall(json.dumps(self.settings).encode())
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self.feed.detach()
        self.feed.sock = ours
        self._started = time.monotonic()
        self._reported = {}

    def reports(self) -> None:
        """Count what the exporter reported it dropped since the last look (its reports
        carry totals: each counted once, whatever was missed in between)."""
        sock = self.feed.sock
        latest = None
        while sock is not None:
            try:
                data = sock.recv(65536)
            except OSError:  # (nothing more now; or the exporter is gone: `watch`)
                break
            if not data:
                break
            if data[:1] == b"D":
                latest = data[1:]
        if latest is None:
            return
        try:
            totals = json.loads(latest)
        except ValueError:
            return
        for key, total in totals.items():
            signal, _, reason = str(key).partition("/")
            if isinstance(total, int) and total > self._reported.get(key, 0):
                metrics.child(metrics.TELEMETRY_EXPORT_DROPPED, signal, reason).inc(
                    total - self._reported.get(key, 0))
                self._reported[key] = total

    def watch(self) -> None:
        """Look at the exporter every WATCH seconds on the running loop: one that exited
        is restarted after the backoff (its frames meanwhile dropped and counted)."""
        self._timer = None
        if self._closed:
            return
        self.reports()
        now = time.monotonic()
        proc = self.proc
        if self._due is None and proc is not None and proc.poll() is not None:
            self.feed.detach()
            if now - self._started >= STABLE:
                self._wait = BACKOFF[0]
            log.warning("telemetry: the exporter process exited (code %s); restarting it "
                        "in %.0f s, audit lines meanwhile are not exported", proc.returncode,
                        self._wait)
            self._due = now + self._wait
            self._wait = min(self._wait * 2, BACKOFF[1])
        if self._due is not None and now >= self._due:
            self._due = None
            self.restarts += 1
            try:
                self.start()
            except OSError as exc:
                log.warning("telemetry: the exporter process could not start: %s", exc)
                self._due = now + self._wait
        self._timer = asyncio.get_running_loop().call_later(WATCH, self.watch)

    async def close(self, timeout: float = 10.0) -> None:
        """Send what is queued (waiting up to 2 s for the exporter to take it), end the
        socket so the exporter exports what it holds and exits; kill it past `timeout`."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        sock = self.feed.sock
        if sock is not None:
            sock.settimeout(2.0)
            await asyncio.to_thread(self.feed.flush)
            self.feed.detach()
        proc = self.proc
        if proc is None:
            return
        try:
            await asyncio.to_thread(proc.wait, timeout)
        except subprocess.TimeoutExpired:
            log.warning("telemetry: the exporter process did not finish within %.0f s; "
                        "killed", timeout)
            proc.kill()
            await asyncio.to_thread(proc.wait)
