"""Ending what no longer holds: every open connection whose identity does not (token
expired or revoked, the family it was refreshed from revoked, policy gone, a transparent
sandbox no longer registered as it was) or whose tunnel's grant was revoked."""

from __future__ import annotations

import logging

from gateway.core.refusal import Refusal
from gateway.pipeline.asking import Asking
from gateway.pipeline.parts import Parts

log = logging.getLogger("sandbox_gateway")

__all__ = ["Sweep"]


class Sweep:
    """See the module docstring; `run` is called every half second on every worker."""

    def __init__(self, parts: Parts, asking: Asking) -> None:
        self.parts = parts
        self.asking = asking

    def run(self) -> int:
        """End every open connection whose identity no longer holds (`recheck`).
        Requests are checked one by one as they come; this ends what sends no more
        requests - passthrough tunnels, idle keep-alive tunnels, streams, WebSockets -
        on every engine. A token that merely expired ends passthrough tunnels only: an
        intercepted request under way when it expired may finish (its next request is
        refused), as the token's holder did nothing wrong. Returns how many were ended;
        their audit lines carry the code (`ended_by`)."""
        ended = 0
        for client in self.parts.connections.clients():
            identity, end = client.identity, client.end
            if identity is None or end is None or client.ended_by is not None:
                continue
            if self.asking.grant_gone(client):
                client.ended_by = "grant_revoked"
                log.info("ended the connection from %s:%s of sandbox %s: its grant ended",
                         *client.peer, identity.sandbox)
                end()
                ended += 1
                continue
            if client.token is None and not client.registered:
                continue
            try:
                self.parts.identities.recheck(client)
                continue
            except Refusal as refused:
                if refused.code == "token_expired" and not (
                        client.tunnel is not None and client.tunnel.passthrough):
                    continue  # (an intercepted request under way may finish)
                if refused.code == "identity_unavailable":
                    continue  # (a stale pod watch refuses what is new, ends nothing)
                client.ended_by = refused.code
            log.info("ended the connection from %s:%s of sandbox %s: %s", *client.peer,
                     identity.sandbox, client.ended_by)
            end()
            ended += 1
        return ended
