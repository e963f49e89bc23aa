"""A rule with `mcp.oauth`: the gateway is the MCP server's OAuth client. The sandbox
sends no token (one it sends is refused, `mcp_token_refused`); the gateway attaches the
access token of the grant that serves the sandbox (`McpTokens`), bound to the server's
resource (the audience check, RFC 8707), and where there is none yet holds the request
while a person consents (an approval of kind ``oauth``, answered by completing its
authorization URL; as long as the rule's or policy's `ask.timeout` says, else 300 s:
`consent_ask`), then goes on with the new token. A rule whose grants are per person
(`consent: user`) refuses a token that names no user (`mcp_user_required`).

The token is put in the head after the head's leak scan, as a credential is, and the
exchange redacts its echoes in the answer (`Exchange.injected`); on every other host the
token is a leak marker (`Markers`). The server's refusal of the token is read in the
answer (`exchange_oauth.OAuthUse`)."""

from __future__ import annotations

from gateway.core.mcp_oauth import (
    audience_covers,
    consent_ask,
    oauth_failed,
    resource_uri,
    token_presented,
    user_required,
)
from gateway.core.policy.mcp_rule import McpOAuth
from gateway.core.refusal import Refusal
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.exchange_oauth import OAuthUse
from gateway.pipeline.parts import Parts

__all__ = ["OAuthing"]


class OAuthing:
    """Attaches an MCP server's token to an exchange (see the module docstring)."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts

    async def attach(self, ex: Exchange, oauth: McpOAuth) -> None:
        """Put the grant's token in `ex` (holding for a consent first if there is no
        grant). Raises Refusal."""
        found = ex.decision.rule
        rule = found.source if found is not None else None
        if ex.head.headers.get("authorization") is not None:
            raise token_presented(rule)
        if oauth.consent == "user" and not ex.identity.user:
            raise user_required(rule)
        tokens = self.parts.mcp_tokens
        if tokens is None:
            raise oauth_failed("this gateway has no MCP OAuth client", rule)
        tgt = ex.target
        if tgt.scheme != "https":
            raise Refusal("credential_requires_tls", "the gateway sends an MCP server's "
                          "OAuth token over TLS only; use https://", rule)
        resource = resource_uri(tgt.scheme, tgt.host, tgt.port, tgt.path)
        token = await tokens.token(ex.identity, resource, oauth)
        if token is None:
            spec = consent_ask(found.ask if found is not None else None,
                               self.parts.policy(ex.identity).ask)
            await tokens.consent(ex.identity, resource, oauth, spec, rule)
            token = await tokens.token(ex.identity, resource, oauth)
            if token is None:
                raise oauth_failed("the consent completed, and its grant cannot be used",
                                   rule)
        if not audience_covers(token.resource, resource):
            raise Refusal("mcp_oauth_failed", f"{token.describe()} was issued for "
                          f"{token.resource}, not {resource}; it is sent only to the "
                          "resource it was issued for", rule)
        ex.head.headers.set("Authorization", f"Bearer {token.value.reveal()}")
        ex.injected("mcp-oauth", f"mcp-oauth:{token.grant}", token.value)
        ex.credential = f"mcp-oauth:{token.grant} ({token.owner})"
        ex.oauth = OAuthUse(tokens, token, resource, rule)
