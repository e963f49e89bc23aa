"""`mcp:` on a rule: which MCP tools, resources and prompts a server's JSON-RPC calls may
name (pure). The core reads the calls (`gateway/core/mcp.py`); this says yes or no.

Each kind has `allow` and `deny` globs (`*`, `?`, `[...]`): a deny match wins, and a name
no allow glob matches is refused — so a kind the rule does not list allows nothing.
`arguments` constrains a tool's string arguments by glob (a constrained argument that is
missing or not a string is refused).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

__all__ = ["McpRule", "Names"]


@dataclass(frozen=True, slots=True)
class Names:
    """The allow and deny globs of one kind (tools, resources, prompts)."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    def refusal(self, kind: str, name: str) -> str | None:
        """Why `name` is refused, or None if allowed."""
        for pattern in self.deny:
            if fnmatchcase(name, pattern):
                return f"{kind} {name[:200]!r} is denied by the rule's pattern {pattern!r}"
        if any(fnmatchcase(name, pattern) for pattern in self.allow):
            return None
        return f"{kind} {name[:200]!r} is not in the rule's mcp.{kind}s.allow list"

    def describe(self) -> str:
        parts = [f"allow {', '.join(self.allow) or 'nothing'}"]
        if self.deny:
            parts.append(f"deny {', '.join(self.deny)}")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class McpRule:
    """`mcp:` as written (see the module docstring). `pin_descriptions`: a tool whose
    description or input schema changes within a session is refused, not only flagged."""

    tools: Names = Names()
    resources: Names = Names()
    prompts: Names = Names()
    arguments: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    pin_descriptions: bool = False

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
            if not fnmatchcase(value, pattern):
                return (f"tool {tool!r}: argument {key!r} = {value[:200]!r} does not match "
                        f"{pattern!r} (mcp.arguments)")
        return None

    def describe(self) -> str:
        parts = [f"tools {self.tools.describe()}", f"resources {self.resources.describe()}",
                 f"prompts {self.prompts.describe()}"]
        if self.arguments:
            parts.append("arguments of " + ", ".join(sorted(self.arguments)))
        if self.pin_descriptions:
            parts.append("pin_descriptions")
        return "mcp: " + "; ".join(parts)
