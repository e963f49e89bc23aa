"""`mcp:` on an egress rule as a policy file writes it (see `mcp_rule.py`)."""

from __future__ import annotations

from yaml.nodes import MappingNode, Node, ScalarNode

from gateway.core.policy.globs import GlobError, validate_glob
from gateway.core.policy.mcp_rule import McpRule, Names
from gateway.services.policy.nodes import NodeReader

__all__ = ["McpReader"]

_MCP_KEYS = ("tools", "resources", "prompts", "arguments", "pin_descriptions",
             "server_requests")
_KINDS = ("tools", "resources", "prompts")


class McpReader(NodeReader):
    """Reads `mcp:` (errors collected with file and line, as for every key)."""

    def parse_mcp(self, file: str, node: Node) -> McpRule | None:
        keys = self.mapping(file, node, _MCP_KEYS, "mcp")
        if keys is None:
            return None
        ok = True
        kinds: dict[str, Names] = {}
        for kind in _KINDS:
            if kind in keys:
                names = self._names(file, keys[kind][1], f"mcp.{kind}",
                                    segments=kind == "resources")
                ok = ok and names is not None
                kinds[kind] = names or Names()
        arguments: dict[str, dict[str, str]] = {}
        if "arguments" in keys:
            parsed = self._arguments(file, keys["arguments"][1])
            ok = ok and parsed is not None
            arguments = parsed or {}
        pin = False
        if "pin_descriptions" in keys:
            value = self.boolean(file, keys["pin_descriptions"][1], "mcp.pin_descriptions")
            ok = ok and value is not None
            pin = bool(value)
        server_requests = "deny"
        if "server_requests" in keys:
            node = keys["server_requests"][1]
            value = self.scalar(node) if isinstance(node, ScalarNode) else None
            if value not in ("allow", "deny"):
                self.err(file, node, "mcp.server_requests must be allow or deny")
                ok = False
            else:
                server_requests = str(value)
        if not ok:
            return None
        return McpRule(tools=kinds.get("tools", Names()),
                       resources=kinds.get("resources", Names()),
                       prompts=kinds.get("prompts", Names()), arguments=arguments,
                       pin_descriptions=pin, server_requests=server_requests)

    def _glob(self, file: str, node: Node, glob: str) -> bool:
        """Is `glob` a usable segment glob (else the error is recorded)?"""
        try:
            validate_glob(glob)
        except GlobError as exc:
            self.err(file, node, str(exc))
            return False
        return True

    def _names(self, file: str, node: Node, what: str, segments: bool) -> Names | None:
        keys = self.mapping(file, node, ("allow", "deny"), what)
        if keys is None:
            return None
        lists: dict[str, tuple[str, ...]] = {}
        for key in ("allow", "deny"):
            if key not in keys:
                continue
            items = self.string_list(file, keys[key][1], f"{what}.{key}")
            if items is None or (segments and not all(
                    [self._glob(file, item, value) for value, item in items])):
                return None
            lists[key] = tuple(dict.fromkeys(value for value, _ in items))
        return Names(allow=lists.get("allow", ()), deny=lists.get("deny", ()))

    def _arguments(self, file: str, node: Node) -> dict[str, dict[str, str]] | None:
        """`{tool: {argument: glob}}`."""
        if not isinstance(node, MappingNode):
            self.err(file, node, "mcp.arguments must map tool names to {argument: glob}, "
                     'e.g. {get_issue: {repo: "org/*"}}')
            return None
        out: dict[str, dict[str, str]] = {}
        ok = True
        for tool_node, spec in node.value:
            tool = self.scalar(tool_node) if isinstance(tool_node, ScalarNode) else None
            if not isinstance(tool, str) or not tool:
                self.err(file, tool_node, "mcp.arguments keys must be tool names")
                ok = False
                continue
            if not isinstance(spec, MappingNode):
                self.err(file, spec, f"mcp.arguments.{tool} must map argument names to globs")
                ok = False
                continue
            globs: dict[str, str] = {}
            for arg_node, glob_node in spec.value:
                arg = self.scalar(arg_node) if isinstance(arg_node, ScalarNode) else None
                glob = self.string(file, glob_node, f"mcp.arguments.{tool}.{arg}")
                if not isinstance(arg, str) or glob is None or \
                        not self._glob(file, glob_node, glob):
                    ok = False
                    continue
                globs[arg] = glob
            out[tool] = globs
        return out if ok else None
