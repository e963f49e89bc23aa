"""`mcp:` on a rule: which MCP tools, resources and prompts a server's JSON-RPC calls may
name (pure). The core reads the calls (`gateway/core/mcp.py`); this says yes or no.

Each kind has `allow` and `deny` globs (`*`, `**`, `?`, `[...]`: the policy files' one
glob matcher, `globs.py`): a deny match wins, and a name no allow glob matches is refused
— so a kind the rule does not list allows nothing. Tool and prompt names are names (`*`
matches any characters); resource URIs are matched by `/`-separated segment (`*` within
one, `**` across), as the server reads them (`mcp_values.py`: escapes decoded once, dot
segments resolved; a URI that cannot be read one way only is refused), and a deny glob
also refuses what lies beneath its match. `arguments` constrains a tool's string
arguments by the same segment globs, read the same way (a constrained argument that is
missing, not a string or not readable one way only is refused).

`oauth` makes the gateway the server's OAuth client (`McpOAuth`, docs/mcp-oauth.md): the
sandbox sends no token, the gateway attaches one a person consented to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.core.policy.globs import compile_glob
from gateway.core.policy.mcp_values import normalize_value

__all__ = ["CONSENTS", "McpOAuth", "McpRule", "Names"]

CONSENTS = ("sandbox", "policy", "user")  # whose grant a consent makes (see McpOAuth)


@dataclass(frozen=True, slots=True)
class Names:
    """The allow and deny globs of one kind (tools, resources, prompts)."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    def refusal(self, kind: str, name: str, segments: bool = False) -> str | None:
        """Why `name` is refused, or None if allowed; `segments`: `name` is a URI,
        matched by segment once read (`normalize_value`)."""
        read = name
        if segments:
            read, problem = normalize_value(name)
            if problem is not None:
                return (f"{kind} {name[:200]!r} is refused: it {problem}, so it cannot be "
                        f"matched against mcp.{kind}s")
        for pattern in self.deny:
            if compile_glob(pattern, segments, True).fullmatch(read):
                return f"{kind} {name[:200]!r} is denied by the rule's pattern {pattern!r}"
        if any(compile_glob(p, segments).fullmatch(read) for p in self.allow):
            return None
        shown = "" if read == name else f" (read as {read[:200]!r})"
        return f"{kind} {name[:200]!r}{shown} is not in the rule's mcp.{kind}s.allow list"

    def describe(self) -> str:
        parts = [f"allow {', '.join(self.allow) or 'nothing'}"]
        if self.deny:
            parts.append(f"deny {', '.join(self.deny)}")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class McpOAuth:
    """`mcp.oauth`: the gateway obtains the server's OAuth tokens itself. `scopes` the
    scopes it asks for (none: what the server's metadata names); `client` a client named
    in the gateway's config (`mcp_oauth.clients`) or ``auto`` (a client ID metadata
    document where the authorization server supports one, else dynamic registration);
    `consent` whose grant one consent makes: this ``sandbox`` only, every sandbox of the
    ``policy``, or every sandbox whose token names the same ``user``."""

    scopes: tuple[str, ...] = ()
    client: str = "auto"
    consent: str = "sandbox"

    def describe(self) -> str:
        scopes = " ".join(self.scopes) or "the server's"
        return f"oauth (scopes {scopes}; client {self.client}; consent per {self.consent})"


@dataclass(frozen=True, slots=True)
class McpRule:
    """`mcp:` as written (see the module docstring). `pin_descriptions`: a tool whose
    description or input schema changes within a session is refused, not only flagged.
    `server_requests`: whether the server's own requests to the client (sampling,
    elicitation, roots; a ping always passes) reach it ("allow") or are answered by the
    gateway with an error ("deny", the default)."""

    tools: Names = Names()
    resources: Names = Names()
    prompts: Names = Names()
    arguments: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    pin_descriptions: bool = False
    server_requests: str = "deny"
    oauth: McpOAuth | None = None

    def resource_refusal(self, uri: str) -> str | None:
        """Why reading (subscribing to) resource `uri` is refused, or None."""
        return self.resources.refusal("resource", uri, segments=True)

    def argument_refusal(self, tool: str, arguments: object) -> str | None:
        """Why a call of `tool` with these arguments is refused, or None."""
        wanted = self.arguments.get(tool)
        if not wanted:
            return None
        given = arguments if isinstance(arguments, dict) else {}
        for key, pattern in wanted.items():
            value = given.get(key)
            if not isinstance(value, str):
                return (f"tool {tool!r} needs argument {key!r} as a string matching "
                        f"{pattern!r} (mcp.arguments)")
            read, problem = normalize_value(value)
            if problem is not None:
                return (f"tool {tool!r}: argument {key!r} = {value[:200]!r} is refused: it "
                        f"{problem}, so it cannot be matched against {pattern!r} "
                        "(mcp.arguments)")
            if not compile_glob(pattern).fullmatch(read):
                shown = "" if read == value else f" (read as {read[:200]!r})"
                return (f"tool {tool!r}: argument {key!r} = {value[:200]!r}{shown} does not "
                        f"match {pattern!r} (mcp.arguments; '*' matches within one "
                        "'/'-separated segment, '**' across)")
        return None

    def describe(self) -> str:
        parts = [f"tools {self.tools.describe()}", f"resources {self.resources.describe()}",
                 f"prompts {self.prompts.describe()}"]
        if self.arguments:
            parts.append("arguments of " + ", ".join(sorted(self.arguments)))
        if self.pin_descriptions:
            parts.append("pin_descriptions")
        if self.server_requests == "allow":
            parts.append("server_requests allow")
        if self.oauth is not None:
            parts.append(self.oauth.describe())
        return "mcp: " + "; ".join(parts)
