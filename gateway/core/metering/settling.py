"""Which reservation an ended response of a WebSocket session settles, when the session
runs several at once.

A Responses or Realtime session may run responses in parallel, and the provider names
each by an id of its own that the gateway can tie to a ``response.create`` only by the
order of ``response.created`` events: an order a provider need not keep (responses queue
for a slot and start as slots free). Settling the wrong reservation with a short
response's usage would release a long response's bound while it still runs, and the
budget would admit calls it has no room for (1.2x over, measured).

So the choice does not trust ids. Every pending reservation of the session is the bound
of a response still running or queued; of an ended response only its usage is known,
and its own bound covers it. Releasing the *smallest reservation that covers the usage*
leaves, for the responses still running, reservations at least as large as theirs, one
for one; charging the usage keeps what was used counted. An ended response whose usage
cannot be read releases the smallest reservation and is charged the largest (its own is
somewhere between). A usage no reservation covers (a provider billing over every bound
it was given) releases the largest, which is the most a response of the session could
use. An id that matches breaks ties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Bound", "Ending", "ending"]


@dataclass(frozen=True, slots=True)
class Bound:
    """One pending reservation: tokens and nano-USD, and the response id tied to it
    (None: none yet)."""

    tokens: int
    nano_usd: int
    response_id: str | None = None


@dataclass(frozen=True, slots=True)
class Ending:
    """The reservation to release (an index into the pending ones) and what to charge:
    ``tokens``/``nano_usd`` None charge the response's own usage."""

    index: int
    tokens: int | None = None
    nano_usd: int | None = None


def ending(pending: Sequence[Bound], used: tuple[int, int] | None,
           response_id: str | None) -> Ending:
    """The reservation an ended response settles (see the module docstring). ``used``:
    the response's tokens and nano-USD, None when its usage could not be read."""
    if not pending:
        raise ValueError("no pending reservation")
    order = sorted(range(len(pending)), key=lambda i: (
        pending[i].tokens, pending[i].nano_usd,
        pending[i].response_id is None or pending[i].response_id != response_id))
    if used is None:
        return Ending(order[0], max(b.tokens for b in pending),
                      max(b.nano_usd for b in pending))
    tokens, nano = used
    covering = [i for i in order
                if pending[i].tokens >= tokens and pending[i].nano_usd >= nano]
    if covering:
        return Ending(covering[0])
    return Ending(max(order, key=lambda i: (pending[i].tokens, pending[i].nano_usd)))
