"""A client connection as the core knows it (`Client`), the tunnel it holds (`Tunnel`),
and `Refused`: a refusal already audited, with the answer an engine sends."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.core.addresses import Pinned
from gateway.core.identity import Identity
from gateway.core.names import DestinationError, normalize_host
from gateway.core.policy import Decision
from gateway.core.refusal import Answer, Refusal

__all__ = ["Client", "Refused", "Tunnel", "source_of"]


@dataclass(slots=True)
class Tunnel:
    """An admitted tunnel (CONNECT, or a transparent connection): where it goes, how
    it was decided, and the address checked for it."""

    host: str
    port: int
    decision: Decision
    pinned: Pinned | None  # None: served by the gateway itself (the local API's host)
    passthrough: bool
    tcp: bool
    started: float = field(default_factory=time.time)  # (the gate passes its clock's)
    audited: bool = False  # a line was written for it (an exchange, a refusal inside it)


@dataclass(slots=True, eq=False)
class Client:
    """One client connection. `listener`: proxy or transparent; `engine`: which engine
    serves it now (named on audit lines)."""

    peer: tuple[str, int]
    listener: str = "proxy"
    engine: str = "h1"
    identity: Identity | None = None
    token: str | None = None
    registered: bool = False  # identity from the transparent registry (source address)
    tunnel: Tunnel | None = None
    pins: dict[tuple[str, int], Pinned] = field(default_factory=dict)
    open: bool = False  # counted in the open-connections gauge
    counted: str | None = None  # the sandbox whose connection limit this one counts against
    end: Callable[[], None] | None = None  # ends the connection now, whichever engine has it
    ended_by: str | None = None  # the gate ended it (`sweep`): the code its lines carry


class Refused(Exception):
    """A refusal that has been audited, with its rendered answer (what the engine
    sends, if the client can still read one). `inside`: a refused CONNECT to be answered
    inside TLS with a leaf for this name (the gate's `answer_inside` renders it for the
    request that comes), rather than at the CONNECT."""

    def __init__(self, refusal: Refusal, answer: Answer, inside: str | None = None) -> None:
        super().__init__(refusal.code)
        self.refusal = refusal
        self.answer = answer
        self.inside = inside


def source_of(client: Client) -> str:
    """The client's source address, normalised (as tokens' `cidr` and the registry
    compare it)."""
    try:
        return normalize_host(client.peer[0])
    except DestinationError:
        return client.peer[0]
