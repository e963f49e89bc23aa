"""The gateway as an MCP server's OAuth client, the pure part (docs/mcp-oauth.md): what a
server's `WWW-Authenticate` challenge says (RFC 6750 3, RFC 9728 5.1), which resource a
request is for and whether a token issued for one resource may go to a request
(RFC 8707: a token goes only to the resource it was issued for), whose grant serves a
sandbox (`mcp.oauth.consent`), and the refusals of this path.

The services (`gateway/services/mcp_oauth/`) discover, register, ask and store; the
pipeline (`pipeline/oauthing.py`) asks them through the `McpTokens` port.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.core.identity import Identity
from gateway.core.policy.ask_rule import Ask
from gateway.core.policy.mcp_rule import McpOAuth
from gateway.core.refusal import Refusal
from gateway.core.secret_value import SecretValue

__all__ = ["CONSENT_TIMEOUT", "Challenge", "McpToken", "audience_covers", "consent_ask",
           "consent_required", "grant_owner", "oauth_failed", "parse_challenge",
           "resource_uri", "token_presented", "user_required"]

# (Possessive spaces: a value never begins with one, and a space given back never makes
# a match; backtracking made `a =` and spaces quadratic.)
_PARAM = re.compile(r'\s*+([A-Za-z0-9_.-]+)\s*+=\s*+("(?:[^"\\]|\\.)*+"|[^\s,"]*+)\s*+(,|$)')
_MAX_CHALLENGE = 4096


@dataclass(frozen=True, slots=True)
class Challenge:
    """A Bearer challenge: `error` (``invalid_token``, ``insufficient_scope``, ...),
    the `scopes` it names (the step-up a 403 asks for), and `resource_metadata`, the URL
    of the server's protected-resource metadata (RFC 9728)."""

    error: str | None = None
    scopes: tuple[str, ...] = ()
    resource_metadata: str | None = None

    @property
    def insufficient_scope(self) -> bool:
        return self.error == "insufficient_scope"


def parse_challenge(values: list[str]) -> Challenge | None:
    """The Bearer challenge among `WWW-Authenticate` field values (None: no Bearer
    challenge the gateway can read). Only the Bearer scheme's parameters are read; a
    value longer than 4 KiB is not read."""
    for value in values:
        if len(value) > _MAX_CHALLENGE:
            continue
        scheme, _, rest = value.strip().partition(" ")
        if scheme.lower() != "bearer":
            continue
        params: dict[str, str] = {}
        at = 0
        while at < len(rest):
            found = _PARAM.match(rest, at)
            if found is None:
                break
            name, raw = found.group(1).lower(), found.group(2)
            if raw.startswith('"'):
                raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
            params.setdefault(name, raw)
            at = found.end()
            if found.group(3) == "":
                break
        return Challenge(error=params.get("error") or None,
                         scopes=tuple(params.get("scope", "").split()),
                         resource_metadata=params.get("resource_metadata") or None)
    return None


def resource_uri(scheme: str, host: str, port: int, path: str) -> str:
    """The canonical URI of the MCP server a request is for (RFC 8707, the MCP
    authorization spec): scheme, lower-case host, a port only where it is not the
    scheme's default, the path without its query and without a trailing slash."""
    default = {"https": 443, "http": 80}.get(scheme)
    shown = f"[{host}]" if ":" in host else host.lower()
    authority = shown if port == default else f"{shown}:{port}"
    bare = path.split("?", 1)[0].split("#", 1)[0].rstrip("/")
    return f"{scheme}://{authority}{bare}"


def audience_covers(resource: str, uri: str) -> bool:
    """May a token issued for `resource` go to a request for `uri` (both canonical,
    `resource_uri`)? The same origin, and the request's path is the resource's or lies
    beneath it (a segment boundary: `/mcp` covers `/mcp/x`, not `/mcpx`)."""
    if uri == resource:
        return True
    return uri.startswith(resource + "/") and resource.count("/") >= 2


CONSENT_TIMEOUT = 300.0  # seconds a request waits for a consent where no ask names one


def consent_ask(rule_ask: Ask | None, policy_ask: Ask | None) -> Ask:
    """How a consent is asked (docs/mcp-oauth.md): held as long as the `timeout` the
    rule's `ask`, else the policy's, names (signing in takes longer than a yes: an
    ask's own 60 s default is not taken), else `CONSENT_TIMEOUT`; told to the notifiers
    of the rule's `ask` and the policy's."""
    named = [a for a in (rule_ask, policy_ask) if a is not None]
    timeout = next((a.timeout for a in named if a.timed), CONSENT_TIMEOUT)
    notify = tuple(dict.fromkeys(n for a in named for n in a.notify))
    return Ask(timeout=timeout, notify=notify, timed=True)


def grant_owner(oauth: McpOAuth, identity: Identity) -> str:
    """Whose grant serves `identity` on a rule with `oauth`: ``sandbox:<name>`` (one
    sandbox's, the default), ``policy:<name>`` (every sandbox of the policy) or
    ``user:<name>`` (every sandbox whose token names that user; ValueError for a token
    naming none: `user_required` is the refusal)."""
    if oauth.consent == "policy":
        return f"policy:{identity.policy}"
    if oauth.consent == "user":
        if not identity.user:
            raise ValueError("consent: user, and the token names no user")
        return f"user:{identity.user}"
    return f"sandbox:{identity.sandbox}"


def user_required(rule: str | None) -> Refusal:
    """`consent: user` on the rule, and the sandbox's token names no user."""
    return Refusal("mcp_user_required", "the rule's mcp.oauth keeps one grant per person "
                   "(consent: user) and this sandbox's token names no user; mint its token "
                   "with the person's name (sandbox-gateway token mint --user NAME, or "
                   "\"user\" in POST /v1/tokens), or set consent: sandbox or policy on the "
                   "rule", rule)


@dataclass(frozen=True, slots=True)
class McpToken:
    """An access token the gateway holds for an MCP server, as the pipeline uses it:
    the `grant` it belongs to (an id, never the token), its `owner` (`grant_owner`),
    the `resource` it was issued for and the `scopes` granted."""

    grant: str
    owner: str
    resource: str
    scopes: tuple[str, ...]
    value: SecretValue

    def describe(self) -> str:
        """For audit lines and reasons: the grant, never the token."""
        return f"MCP OAuth grant {self.grant} ({self.owner}, {self.resource})"


def token_presented(rule: str | None) -> Refusal:
    """The sandbox sent its own `Authorization` on a rule where the gateway is the
    server's OAuth client."""
    return Refusal("mcp_token_refused", "the request carries its own Authorization header "
                   "to an MCP server whose rule has mcp.oauth: the gateway attaches the "
                   "server's token itself, and a token the sandbox holds is refused; send "
                   "the request without Authorization", rule)


def consent_required(reason: str, rule: str | None) -> Refusal:
    """The server refused the gateway's token (or asks for more scopes); the client may
    retry once the gateway has refreshed the token or a person has consented again."""
    return Refusal("mcp_consent_required", f"{reason}; retry the request: the gateway "
                   "refreshes the token or asks a person to consent again (GET "
                   "/v1/approvals, `sandbox-gateway approvals list`)", rule, retry_after=5)


def oauth_failed(reason: str, rule: str | None) -> Refusal:
    """The gateway could not obtain a token (discovery, registration, the token
    endpoint): `reason` in fixed sentences, never the servers' bytes."""
    return Refusal("mcp_oauth_failed", f"the gateway could not obtain the MCP server's "
                   f"OAuth token: {reason}", rule)
