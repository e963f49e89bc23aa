"""Upstream connections that outlive their client connection.

A sandbox that opens a new connection for each request (most CLIs, `pip`, `git`, a
new SDK client per call) would otherwise pay a full upstream TCP and TLS handshake
each time. When a client connection ends, its upstream connection, if it is idle and
clean (the last response ended as framed, nothing more arrived), is parked here; the
next connection of the **same sandbox** to the **same checked destination** (the
pinned address, the server name, TLS or not) takes it instead of dialling.

TLS sessions are not resumed on a new dial: reading a connection's session
(`SSLObject.session`) leaks about 5.6 KB per read in CPython 3.12 with OpenSSL 3.0 when
the server sends TLS 1.3 tickets (measured here: 17 MB per 3,000 connections), which a
long-running gateway cannot afford; a parked connection needs no handshake at all.

The key is `(sandbox, address, host, tls)`: a connection is never handed to another
sandbox, and it goes only where the destination check of the request that takes it
pinned (the check runs for every request, the connection follows its result). Parked
connections are closed after `network.upstream_idle_timeout`, when the upstream closes
them, or past the bounds (`PER_KEY` per key, `PER_SANDBOX` per sandbox, `LIMIT` in
all; fewer when the process has few file descriptors: the app takes the pool's share out
of the connection cap).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.engines.patches import ReceiveBuffer
from gateway.observability import metrics

if TYPE_CHECKING:
    from gateway.engines.h1.side import Upstream

__all__ = ["LIMIT", "PER_KEY", "PER_SANDBOX", "UpstreamPool"]

PER_KEY = 8  # parked connections per (sandbox, destination)
PER_SANDBOX = 32  # parked connections per sandbox: one cannot take the whole pool
LIMIT = 512  # parked connections in all

Key = tuple[object, ...]  # (sandbox, address, host, tls)


class UpstreamPool:
    """See the module docstring. `idle_timeout` <= 0 keeps nothing parked."""

    def __init__(self, idle_timeout: float, limit: int = LIMIT) -> None:
        self.idle_timeout = idle_timeout
        self.limit = limit
        self._parked: dict[Key, list[Upstream]] = {}
        self._count = 0
        self._per_sandbox: dict[object, int] = {}
        self.closed = False

    def __len__(self) -> int:
        return self._count

    def _counted(self, key: Key, delta: int) -> None:
        self._count += delta
        held = self._per_sandbox.get(key[0], 0) + delta
        if held:
            self._per_sandbox[key[0]] = held
        else:
            self._per_sandbox.pop(key[0], None)

    def park(self, upstream: Upstream, now: float) -> None:
        """Keep `upstream` (idle since `now`) for its key's next connection, or close it
        when it cannot serve one or a bound is reached."""
        key = upstream.key
        parked = self._parked.get(key)
        if (self.closed or self.idle_timeout <= 0 or not upstream.reusable()
                or self._count >= self.limit or (parked is not None and len(parked) >= PER_KEY)
                or self._per_sandbox.get(key[0], 0) >= PER_SANDBOX):
            upstream.close()
            return
        upstream.partner = None
        upstream.buf = ReceiveBuffer()  # (empty: drop the capacity a burst left)
        upstream.parked_at = now
        if parked is None:
            parked = self._parked[key] = []
        parked.append(upstream)
        self._counted(key, 1)

    def take(self, key: Key) -> Upstream | None:
        """The most recently parked live connection for `key`, or None."""
        parked = self._parked.get(key)
        while parked:
            upstream = parked.pop()
            self._counted(key, -1)
            if not parked:
                del self._parked[key]
            if upstream.reusable():
                metrics.child(metrics.UPSTREAM_CONNECTIONS, "pooled").inc()
                return upstream
            upstream.close()
        return None

    def expire(self, now: float) -> None:
        """Close what was parked longer than the idle timeout or was closed upstream."""
        before = now - self.idle_timeout
        for key in list(self._parked):
            parked = self._parked[key]
            kept = [u for u in parked if u.parked_at > before and u.reusable()]
            if len(kept) == len(parked):
                continue
            keep = {id(u) for u in kept}
            for upstream in parked:
                if id(upstream) not in keep:
                    upstream.close()
            self._counted(key, len(kept) - len(parked))
            if kept:
                self._parked[key] = kept
            else:
                del self._parked[key]

    def close_all(self) -> None:
        """Close everything parked and park nothing more (shutdown, a drain)."""
        self.closed = True
        for parked in self._parked.values():
            for upstream in parked:
                upstream.close()
        self._parked.clear()
        self._count = 0
        self._per_sandbox.clear()
