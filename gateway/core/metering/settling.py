"""Which reservation an ended response of a WebSocket session settles, when the session
runs several at once.

A Responses or Realtime session may run responses in parallel, and the provider names
each by an id of its own that the gateway can tie to a ``response.create`` only by the
order of ``response.created`` events: an order a provider need not keep (responses queue
for a slot and start as slots free). Settling the wrong reservation with a short
response's usage would release a long response's bound while it still runs, and the
budget would admit calls it has no room for (1.2x over, measured).

So the choice does not trust ids. Every pending reservation of the session is the bound
of a response still running or queued, or of one that ended unread (below); of an ended
response only its usage is known, and its own bound covers it. Releasing the *smallest
reservation that covers the usage* leaves, for the responses not yet settled,
reservations at least as large as theirs, one for one; charging the usage keeps what was
used counted, and never more than the reservation released: what a session has charged
and still holds stays within what it reserved when its calls were admitted.

An ended response whose usage cannot be read could be any of them, so it releases
nothing (``index`` None): its reservation, whichever it is, stays held, and the caller
counts it. Once every reservation left is one of an unread ending's (``all_unread``),
each is charged in full. (Charging it the largest bound while releasing the smallest,
as before, charged more than was reserved: 1.02x a budget, measured.) A usage no
reservation covers (a provider billing over every bound it was given) releases the
largest, which is the most a response of the session could use. An id that matches
breaks ties. An error that refuses a response before it began releases the smallest
reservation of all: whichever response it refused had a bound at least that large.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Bound", "Ending", "all_unread", "ending"]


@dataclass(frozen=True, slots=True)
class Bound:
    """One pending reservation: tokens and nano-USD, and the response id tied to it
    (None: none yet)."""

    tokens: int
    nano_usd: int
    response_id: str | None = None


@dataclass(frozen=True, slots=True)
class Ending:
    """The reservation to release (an index into the pending ones; None: none, the
    response ended unread)."""

    index: int | None


def ending(pending: Sequence[Bound], used: tuple[int, int] | None,
           response_id: str | None) -> Ending:
    """The reservation an ended response settles (see the module docstring). ``used``:
    the response's tokens and nano-USD, None when its usage could not be read."""
    if not pending:
        raise ValueError("no pending reservation")
    if used is None:
        return Ending(None)
    order = sorted(range(len(pending)), key=lambda i: (
        pending[i].tokens, pending[i].nano_usd,
        pending[i].response_id is None or pending[i].response_id != response_id))
    tokens, nano = used
    covering = [i for i in order
                if pending[i].tokens >= tokens and pending[i].nano_usd >= nano]
    if covering:
        return Ending(covering[0])
    return Ending(max(order, key=lambda i: (pending[i].tokens, pending[i].nano_usd)))


def all_unread(pending: int, unread: int) -> bool:
    """Whether the ``pending`` reservations left are all of responses that ended unread
    (``unread`` of them): nothing still running can settle them, so each is charged in
    full."""
    return pending > 0 and unread >= pending
