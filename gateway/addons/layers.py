"""Step 4, passthrough or intercept: pick the protocol layer for a tunnel's bytes.

A tunnel whose rule needs no request inspection is spliced as raw bytes (no TLS
interception: the sandbox sees the upstream's own certificate, and a download pays
only the relay cost). Its first bytes must be a TLS ClientHello unless the rule says
`protocol: tcp`; anything else is refused and the connection closed at once.
Everything else goes to mitmproxy's own layer selection (TLS interception, HTTP).
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from typing import Any

from mitmproxy.addons.next_layer import NextLayer
from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers import HttpLayer, TCPLayer, modes
from mitmproxy.proxy.layers.http import HttpStream

from gateway.addons.common import Sessions, fail_closed

log = logging.getLogger("sandbox_gateway")


class RefuseLayer(layer.Layer):
    """Closes the client connection at once; used for bytes a tunnel may not carry."""

    def __init__(self, context: Context, reason: str) -> None:
        super().__init__(context)
        self.reason = reason
        self.closed = False

    def _handle_event(self, event: events.Event) -> Generator[commands.Command, Any, None]:
        if not self.closed:
            self.closed = True
            yield commands.Log(f"refused tunnel bytes: {self.reason}", logging.WARNING)
            yield commands.CloseConnection(self.context.client)


def _is_tunnel_start(context: Context) -> bool:
    """True for the first layer inside a CONNECT tunnel of the regular proxy."""
    layers = context.layers
    return (len(layers) == 3 and isinstance(layers[0], modes.HttpProxy)
            and isinstance(layers[1], HttpLayer) and isinstance(layers[2], HttpStream))


class SelectLayer(NextLayer):
    """mitmproxy's NextLayer, with the gateway's passthrough decision taken first."""

    name = "nextlayer"  # proxyserver looks the layer chooser up by this name

    def __init__(self, sessions: Sessions) -> None:
        super().__init__()
        self.sessions = sessions

    @fail_closed
    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        if nextlayer.layer is not None:
            return
        context = nextlayer.context
        if _is_tunnel_start(context):
            session = self.sessions.peek(context.client)
            tunnel = session.tunnel if session is not None else None
            if tunnel is None:
                nextlayer.layer = RefuseLayer(context, "tunnel without a decision")
                return
            rule = tunnel.decision.rule if tunnel.decision is not None else None
            if rule is not None and rule.protocol == "tcp":
                nextlayer.layer = TCPLayer(context, ignore=True)
                return
            if tunnel.passthrough:
                data = nextlayer.data_client()
                if starts_like_tls_record(data):
                    nextlayer.layer = TCPLayer(context, ignore=True)
                elif len(data) >= 3:
                    nextlayer.layer = RefuseLayer(
                        context, f"non-TLS bytes in a tunnel to {tunnel.host}:{tunnel.port}; "
                        "add protocol: tcp to the rule to allow raw TCP")
                return  # fewer than 3 bytes: wait for more
        elif len(context.layers) == 1 and isinstance(context.layers[0], modes.TransparentProxy):
            session = self.sessions.peek(context.client)
            if session is None or session.tunnel is None:
                return  # the Transparent addon has not decided yet: wait for more bytes
        super().next_layer(nextlayer)
