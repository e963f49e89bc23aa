"""Which leak markers a request is scanned for, cached per (host, token) until the
policies, the fetched keys, the provider-minted secrets or the MCP servers' OAuth tokens
change."""

from __future__ import annotations

from collections.abc import Callable

from gateway.core.leak_forms import constant_token_markers, own_token_markers, sensitive_markers
from gateway.core.leaks import LeakScan
from gateway.core.policy import PolicySet
from gateway.core.ports import McpTokens, MintedSecrets, Secrets
from gateway.core.secret_value import SecretValue

__all__ = ["Markers"]

_CACHE = 10_000


class Markers:
    """The leak scans of requests: every gateway token's constant parts and the
    client's own token, plus every fetched key and provider-minted secret that no
    credential binds to the request's host, and every alias of a provider-minted secret
    on every host (like a token: its one place is the carrier of a request to its
    credential's host, swapped before the scan), and every MCP server's OAuth token the
    gateway holds on every host but its server's (`oauth`: the sandbox never holds one)."""

    def __init__(self, policies: Callable[[], PolicySet], secrets: Secrets,
                 ephemeral: MintedSecrets, issuer: Callable[[], str]) -> None:
        self._policies = policies
        self._secrets = secrets
        self._ephemeral = ephemeral
        self._issuer = issuer
        self._scans: dict[tuple[str, str | None], LeakScan] = {}
        self._version: tuple[object, ...] = ()
        self.oauth: McpTokens | None = None

    def scan_for(self, host: str, token: str | None) -> LeakScan:
        """The scan for a request to `host` from a client holding `token`."""
        policy_set = self._policies()
        known = self._secrets.known_items()
        oauth = self.oauth
        version = (id(policy_set), self._ephemeral.version,
                   tuple(id(value) for _, value in known),
                   oauth.version if oauth is not None else 0)
        if version != self._version or len(self._scans) > _CACHE:
            self._scans.clear()
            self._version = version
        key = (host, token)
        scan = self._scans.get(key)
        if scan is None:
            creds = policy_set.credentials.values()
            secrets = [m for name, value in known
                       if not any(c.secret == name and c.binds(host) for c in creds)
                       for m in _markers_of(value)]
            for minted in self._ephemeral.live():
                bound = policy_set.credentials.get(minted.credential)
                if bound is None or not bound.binds(host):
                    secrets.extend(_markers_of(minted.value))
                if minted.alias is not None:
                    secrets.extend(_markers_of(minted.alias))
            for server, held in oauth.live() if oauth is not None else ():
                if server != host:
                    secrets.extend(_markers_of(held))
            scan = self._scans[key] = LeakScan(constant_token_markers(self._issuer()),
                                               secrets, own_token_markers(token or ""))
        return scan


_MARKERS: dict[int, tuple[SecretValue, frozenset[bytes]]] = {}


def _markers_of(value: SecretValue) -> frozenset[bytes]:
    cached = _MARKERS.get(id(value))
    if cached is None or cached[0] is not value:
        if len(_MARKERS) > 1024:
            _MARKERS.clear()
        markers = frozenset().union(*(sensitive_markers(p.encode()) for p in value.pieces()))
        cached = _MARKERS[id(value)] = (value, markers)
    return cached[1]
