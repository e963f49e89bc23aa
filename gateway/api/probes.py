"""The probes (`/healthz`: liveness, `/readyz`: readiness), answered even when the admin
listener is full.

The admin listener holds at most `admin.max_connections` connections (`api/bounds.py`).
Idle or slow clients holding all of them must not make the kubelet's probes fail: a
failing readiness probe takes a healthy pod out of service, a failing liveness probe
restarts it. So a connection past the cap is not refused at once but taken into a small
reserve (`RESERVE` connections; a new one past that closes the oldest, answered 503) and
read only as far as its request head (h11's parser, at most `MAX_HEAD` bytes, within
`WAIT` seconds). A `GET` or `HEAD` of a probe path is answered and closed; any other
request, a head that does not come within `WAIT`, or a connection closed to make room is
answered `503 too_many_connections` and closed. The reserve costs at most `RESERVE`
descriptors more than the cap, each for at most `WAIT` seconds.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import h11

from gateway.api.context import Readiness
from gateway.api.errors import raw_answer, raw_error

__all__ = ["MAX_HEAD", "PATHS", "RESERVE", "WAIT", "Answer", "ProbeReader", "Reserve", "answer"]

PATHS = ("/healthz", "/readyz")
RESERVE = 8  # connections past the cap read for a probe at once
WAIT = 2.0  # seconds a connection past the cap has to send its request head
MAX_HEAD = 4096  # a probe's head (the kubelet's is about 100 bytes)

Answer = tuple[int, dict[str, Any]]


def answer(path: str, readiness: Readiness) -> Answer | None:
    """The probe answer for `path` (status, JSON body), None if it is no probe path.
    `/healthz`: the process answers; `/readyz`: `readiness.ready()`, 503 when not ready,
    and `degraded`, what serves on in a degraded way (e.g. `["state store"]`), when
    something does. The admin API's routes and the reserve past the cap both answer
    with it."""
    if path == "/healthz":
        return 200, {"status": "ok"}
    if path == "/readyz":
        ok, why = readiness.ready()
        body: dict[str, Any] = {"ready": ok, "reason": why}
        degraded = readiness.degraded()
        if degraded:
            body["degraded"] = degraded
        return (200 if ok else 503), body
    return None


class Reserve:
    """The connections past the admin listener's cap, each read for a probe request."""

    def __init__(self, probe: Callable[[str], Answer | None], limit: int) -> None:
        self.probe = probe  # path -> the answer, None for another path
        self.limit = limit  # admin.max_connections (named in the refusal)
        self.waiting: OrderedDict[int, ProbeReader] = OrderedDict()

    def admit(self, transport: asyncio.Transport) -> ProbeReader:
        """Take `transport` (a connection past the cap); the oldest waiting connection is
        closed (503) when the reserve is full."""
        while len(self.waiting) >= RESERVE:
            _, oldest = self.waiting.popitem(last=False)
            oldest.refuse("this connection was closed to make room for a newer one")
        reader = ProbeReader(self, transport)
        self.waiting[id(reader)] = reader
        return reader

    def close(self) -> None:
        """Close every waiting connection (the gateway stops)."""
        for reader in list(self.waiting.values()):
            reader.close()


class ProbeReader:
    """One connection past the cap: its request head read, a probe answered."""

    def __init__(self, reserve: Reserve, transport: asyncio.Transport) -> None:
        self.reserve = reserve
        self.transport = transport
        self.parser = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            WAIT, self.refuse, f"this connection sent no request within {WAIT:g}s")

    def data_received(self, data: bytes) -> None:
        if self.timer is None:  # answered
            return
        self.parser.receive_data(data)
        try:
            event = self.parser.next_event()
        except h11.RemoteProtocolError:
            self._answer(raw_error(400, "Bad Request", "bad_request",
                                   "the request head could not be read"))
            return
        if event is h11.NEED_DATA:
            return
        if not isinstance(event, h11.Request):  # (a client's EOF before a request)
            self.close()
            return
        method = event.method.decode("ascii", "replace")
        path = event.target.decode("ascii", "replace").partition("?")[0]
        found = self.reserve.probe(path) if method in ("GET", "HEAD") else None
        if found is None:
            self.refuse("past it only GET /healthz and /readyz are answered")
            return
        status, body = found
        self._answer(raw_answer(status, "OK" if status == 200 else "Service Unavailable",
                                body, head_only=method == "HEAD"))

    def eof_received(self) -> None:
        self.close()

    def refuse(self, why: str) -> None:
        """503 too_many_connections (past the cap, and not a probe), closed."""
        limit = self.reserve.limit
        self._answer(raw_error(503, "Service Unavailable", "too_many_connections",
                               f"the admin listener has {limit} connections open "
                               f"(admin.max_connections): {why}; retry shortly"))

    def _answer(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)
        self.close()

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.reserve.waiting.pop(id(self), None)
        self.transport.close()
