"""Connection counting: the process-wide cap (from the open-files limit), the process's
other capacity (its memory ceiling, a port) and each sandbox's own limit, so one sandbox
cannot take every descriptor from the others."""

from __future__ import annotations

from gateway.core.client import Client
from gateway.core.ports import SILENT, Capacity, Telemetry
from gateway.core.refusal import Refusal

__all__ = ["Connections"]


class Connections:
    """Open client connections, in all and per sandbox."""

    def __init__(self, *, per_sandbox: int = 256, limit: int = 1 << 30,
                 telemetry: Telemetry = SILENT, capacity: Capacity | None = None) -> None:
        self.telemetry = telemetry
        self.capacity = capacity
        self.per_sandbox = per_sandbox
        self.limit = limit
        self.open = 0
        self._of: dict[str, int] = {}
        self._clients: set[Client] = set()

    def opened(self, client: Client) -> Refusal | None:
        """Count an accepted connection (idempotent); past the cap, the refusal to
        answer it with (it stays counted until `closed`)."""
        if client.open:
            return None
        client.open = True
        self._clients.add(client)
        self.open += 1
        self.telemetry.gauge("open_connections", 1)
        if self.open > self.limit:
            return Refusal("at_capacity", f"the gateway has {self.limit} open connections, "
                           "its limit (derived from the open-files limit); retry shortly",
                           retry_after=1)
        full = self.capacity.refusing if self.capacity is not None else None
        if full is not None:
            return Refusal("at_capacity", f"{full}; retry shortly", retry_after=1)
        return None

    def compact(self) -> None:
        """Give back the room a burst of connections left in the bookkeeping (a set keeps
        its largest table after its members go): called once a burst has closed."""
        self._clients = set(self._clients)
        self._of = dict(self._of)

    def closed(self, client: Client) -> None:
        """The connection ended (idempotent): uncounted everywhere."""
        if client.open:
            client.open = False
            self._clients.discard(client)
            self.open -= 1
            self.telemetry.gauge("open_connections", -1)
        self.uncount(client)

    def count(self, client: Client) -> None:
        """Count the identified connection against its sandbox's limit (raises Refusal
        past it; a connection whose identity changed sandbox moves)."""
        assert client.identity is not None
        sandbox = client.identity.sandbox
        if client.counted == sandbox:
            return
        if client.counted is not None:
            self.uncount(client)
        used = self._of.get(sandbox, 0)
        if used >= self.per_sandbox:
            raise Refusal("too_many_connections", f"sandbox {sandbox!r} already has {used} "
                          f"open connections (limits.connections_per_sandbox = "
                          f"{self.per_sandbox}); close idle connections or reuse them "
                          "(keep-alive)", retry_after=1)
        self._of[sandbox] = used + 1
        client.counted = sandbox

    def uncount(self, client: Client) -> None:
        sandbox, client.counted = client.counted, None
        if sandbox is not None:
            left = self._of.get(sandbox, 1) - 1
            if left > 0:
                self._of[sandbox] = left
            else:
                self._of.pop(sandbox, None)

    def of(self, sandbox: str) -> int:
        """Open connections counted against `sandbox`."""
        return self._of.get(sandbox, 0)

    def clients(self) -> list[Client]:
        """The open connections now (a copy: the caller may end some)."""
        return list(self._clients)
