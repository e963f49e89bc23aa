"""An exchange carrying a token the gateway holds for an MCP server (`mcp.oauth`): the
server's answer read for a refusal of that token. A 401, or a 403 whose challenge says
`insufficient_scope`, is not relayed (the sandbox holds no token to renew and would try
its own OAuth flow): the grant is marked (`McpTokens.rejected`: stale, refreshed on the
next request; or a step-up consent with the scopes the server names) and the client is
answered `mcp_consent_required`, which it retries."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.mcp_oauth import McpToken, consent_required, parse_challenge
from gateway.core.messages import ResponseHead
from gateway.core.ports import McpTokens

__all__ = ["OAuthUse"]


@dataclass(frozen=True, slots=True)
class OAuthUse:
    """The token an exchange carries, for the `resource` it is sent to."""

    tokens: McpTokens
    token: McpToken
    resource: str
    rule: str | None

    def answered(self, head: ResponseHead) -> None:
        """Raise `mcp_consent_required` if the server refused the token."""
        if head.status not in (401, 403):
            return
        challenge = parse_challenge(head.headers.get_all("www-authenticate"))
        if head.status == 403 and (challenge is None or not challenge.insufficient_scope):
            return  # (a 403 of the server's own: relayed)
        self.tokens.rejected(self.token, self.resource, challenge)
        if head.status == 403:
            wanted = " ".join(challenge.scopes) if challenge is not None else ""
            why = (f"the MCP server asks for more scopes than {self.token.describe()} "
                   f"holds ({wanted or 'unnamed'}): a person consents to them")
        else:
            why = f"the MCP server refused the token of {self.token.describe()}"
        raise consent_required(why, self.rule)
