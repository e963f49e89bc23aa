"""What the addons share: per-connection sessions, flow metadata keys, fail-closed hooks.

mitmproxy logs and swallows exceptions raised in addon hooks, which would let a
crashed check through (a crash in `http_connect` answers 200, in `requestheaders`
forwards the request, in `server_connect` dials anyway). Every enforcing hook is
therefore wrapped with `fail_closed`, which turns an exception into a refusal.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import connection, http, tcp
from mitmproxy.proxy import layer, server_hooks

from gateway.errors import GATEWAY_ERROR, Refusal
from gateway.policy import Decision
from gateway.tokens import Identity

log = logging.getLogger("sandbox_gateway")

# flow.metadata keys (one namespace, named for what they hold)
IDENTITY = "sandbox_gateway.identity"
DECISION = "sandbox_gateway.decision"
REFUSAL = "sandbox_gateway.refusal"
PATH = "sandbox_gateway.path"
CREDENTIAL = "sandbox_gateway.credential"
BYTES_IN = "sandbox_gateway.bytes_in"
AUDITED = "sandbox_gateway.audited"
HOST = "sandbox_gateway.host"  # the normalised destination host the policy decided on
CARRIER = "sandbox_gateway.carrier"
SECRET = "sandbox_gateway.secret"  # (secret name, value) injected into this flow


@dataclass(slots=True)
class Tunnel:
    """An allowed CONNECT: where it goes and how it was decided."""

    host: str
    port: int
    decision: Decision | None  # None: transparent, identity (so policy) known per request
    passthrough: bool
    started: float = field(default_factory=time.time)


@dataclass(slots=True)
class ClientSession:
    """What the gateway knows about one client connection."""

    identity: Identity | None = None
    token: str | None = None
    tunnel: Tunnel | None = None
    pinned: dict[tuple[str, int], Any] = field(default_factory=dict)


class Sessions:
    """Client sessions keyed by mitmproxy's client connection id."""

    def __init__(self) -> None:
        self._by_client: dict[str, ClientSession] = {}

    def get(self, client: connection.Client) -> ClientSession:
        session = self._by_client.get(client.id)
        if session is None:
            session = self._by_client[client.id] = ClientSession()
        return session

    def put(self, client: connection.Client, session: ClientSession) -> None:
        self._by_client[client.id] = session

    def peek(self, client: connection.Client) -> ClientSession | None:
        return self._by_client.get(client.id)

    def drop(self, client: connection.Client) -> ClientSession | None:
        return self._by_client.pop(client.id, None)

    def __len__(self) -> int:
        return len(self._by_client)


def refuse(flow: http.HTTPFlow, refusal: Refusal) -> None:
    """Answer `flow` with the refusal; no upstream connection will be made for it."""
    flow.response = refusal.response()
    flow.metadata[REFUSAL] = refusal


def _refuse_target(target: object) -> None:
    if isinstance(target, http.HTTPFlow):
        if target.response is None:
            refuse(target, GATEWAY_ERROR)
        elif REFUSAL not in target.metadata and target.killable:
            target.kill()  # an upstream response is under way: cut it off
    elif isinstance(target, server_hooks.ServerConnectionHookData):
        target.server.error = "refused: gateway error while checking the destination"
    elif isinstance(target, layer.NextLayer):
        from gateway.addons.layers import RefuseLayer

        target.layer = RefuseLayer(target.context, "gateway error while choosing the layer")
    elif isinstance(target, tcp.TCPFlow):
        target.kill()


def fail_closed[F: Callable[..., Any]](hook: F) -> F:
    """Wrap an addon hook so that an exception refuses what the hook was checking."""
    if inspect.iscoroutinefunction(hook):
        @functools.wraps(hook)
        async def async_wrapper(self: object, target: object, *args: Any) -> Any:
            try:
                return await hook(self, target, *args)
            except Exception:
                log.exception("%s failed; refusing (fail closed)", hook.__qualname__)
                _refuse_target(target)
                return None

        return async_wrapper  # type: ignore[return-value]

    @functools.wraps(hook)
    def wrapper(self: object, target: object, *args: Any) -> Any:
        try:
            return hook(self, target, *args)
        except Exception:
            log.exception("%s failed; refusing (fail closed)", hook.__qualname__)
            _refuse_target(target)
            return None

    return wrapper  # type: ignore[return-value]
