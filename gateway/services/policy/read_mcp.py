"""The `mcp:` reader: an egress rule's MCP tools, resources, prompts, argument globs and
switches, and `oauth:` (the gateway as the server's OAuth client), as a policy file writes
them (semantics in `mcp_rule.py`)."""

from __future__ import annotations

import re

from yaml.nodes import MappingNode, Node, ScalarNode

from gateway.core.policy.globs import GlobError, validate_glob
from gateway.core.policy.mcp_rule import CONSENTS, McpOAuth, McpRule, Names
from gateway.services.policy.nodes import Nodes

__all__ = ["read_mcp"]

_MCP_KEYS = ("tools", "resources", "prompts", "arguments", "pin_descriptions",
             "server_requests", "oauth")
_OAUTH_KEYS = ("scopes", "client", "consent")
_SCOPE = re.compile(r"[\x21\x23-\x5b\x5d-\x7e]+")  # RFC 6749 3.3 scope-token
_CLIENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # a name in mcp_oauth.clients
_KINDS = ("tools", "resources", "prompts")


def read_mcp(nodes: Nodes, node: Node) -> McpRule | None:
    """A rule's ``McpRule`` (None: reported)."""
    keys = nodes.mapping(node, _MCP_KEYS, "mcp")
    if keys is None:
        return None
    ok = True
    kinds: dict[str, Names] = {}
    for kind in _KINDS:
        if kind in keys:
            names = _names(nodes, keys[kind][1], f"mcp.{kind}", segments=kind == "resources")
            ok = ok and names is not None
            kinds[kind] = names or Names()
    arguments: dict[str, dict[str, str]] = {}
    if "arguments" in keys:
        parsed = _arguments(nodes, keys["arguments"][1])
        ok = ok and parsed is not None
        arguments = parsed or {}
    pin = False
    if "pin_descriptions" in keys:
        value = nodes.boolean(keys["pin_descriptions"][1], "mcp.pin_descriptions")
        ok = ok and value is not None
        pin = bool(value)
    server_requests = "deny"
    if "server_requests" in keys:
        requests_node = keys["server_requests"][1]
        choice = nodes.scalar(requests_node) if isinstance(requests_node, ScalarNode) else None
        if choice not in ("allow", "deny"):
            nodes.err(requests_node, "mcp.server_requests must be allow or deny")
            ok = False
        else:
            server_requests = str(choice)
    oauth: McpOAuth | None = None
    if "oauth" in keys:
        oauth = read_oauth(nodes, keys["oauth"][1])
        ok = ok and oauth is not None
    if not ok:
        return None
    return McpRule(tools=kinds.get("tools", Names()), resources=kinds.get("resources", Names()),
                   prompts=kinds.get("prompts", Names()), arguments=arguments,
                   pin_descriptions=pin, server_requests=server_requests, oauth=oauth)


def read_oauth(nodes: Nodes, node: Node) -> McpOAuth | None:
    """`mcp.oauth: {scopes: [...], client: <name> | auto, consent: sandbox | policy}`
    (``oauth: {}``: the server's scopes, client auto, consent per sandbox)."""
    keys = nodes.mapping(node, _OAUTH_KEYS, "mcp.oauth")
    if keys is None:
        return None
    ok = True
    scopes: tuple[str, ...] = ()
    if "scopes" in keys:
        items = nodes.string_list(keys["scopes"][1], "mcp.oauth.scopes")
        ok = items is not None
        for value, item in items or []:
            if not _SCOPE.fullmatch(value):
                nodes.err(item, f"mcp.oauth.scopes: {value[:100]!r} is not an OAuth scope "
                          "(printable ASCII, no space, quote or backslash: RFC 6749 3.3)")
                ok = False
        scopes = tuple(dict.fromkeys(value for value, _ in items or []))
    client = "auto"
    if "client" in keys:
        named = nodes.string(keys["client"][1], "mcp.oauth.client")
        if named is None or not _CLIENT.fullmatch(named):
            if named is not None:
                nodes.err(keys["client"][1], f"mcp.oauth.client: {named[:100]!r} is not a "
                          "client name (letters, digits, '_', '.', '-'; a name in the "
                          "gateway config's mcp_oauth.clients) nor auto")
            ok = False
        else:
            client = named
    consent = "sandbox"
    if "consent" in keys:
        value_node = keys["consent"][1]
        chosen = nodes.scalar(value_node) if isinstance(value_node, ScalarNode) else None
        if chosen not in CONSENTS:
            nodes.err(value_node, "mcp.oauth.consent must be sandbox (the grant serves "
                      "this sandbox), policy (every sandbox of the policy) or user (every "
                      "sandbox whose token names the same user)")
            ok = False
        else:
            consent = str(chosen)
    return McpOAuth(scopes=scopes, client=client, consent=consent) if ok else None


def _glob(nodes: Nodes, node: Node, glob: str) -> bool:
    """Is `glob` a usable segment glob (else the error is reported)?"""
    try:
        validate_glob(glob)
    except GlobError as exc:
        nodes.err(node, str(exc))
        return False
    return True


def _names(nodes: Nodes, node: Node, what: str, segments: bool) -> Names | None:
    """``{allow: [...], deny: [...]}`` of one kind (resources: segment globs)."""
    keys = nodes.mapping(node, ("allow", "deny"), what)
    if keys is None:
        return None
    lists: dict[str, tuple[str, ...]] = {}
    for key in ("allow", "deny"):
        if key not in keys:
            continue
        items = nodes.string_list(keys[key][1], f"{what}.{key}")
        if items is None or (segments and not all(
                [_glob(nodes, item, value) for value, item in items])):
            return None
        lists[key] = tuple(dict.fromkeys(value for value, _ in items))
    return Names(allow=lists.get("allow", ()), deny=lists.get("deny", ()))


def _arguments(nodes: Nodes, node: Node) -> dict[str, dict[str, str]] | None:
    """`{tool: {argument: glob}}`."""
    if not isinstance(node, MappingNode):
        nodes.err(node, "mcp.arguments must map tool names to {argument: glob}, "
                  'e.g. {get_issue: {repo: "org/*"}}')
        return None
    out: dict[str, dict[str, str]] = {}
    ok = True
    for tool_node, spec in node.value:
        tool = nodes.scalar(tool_node) if isinstance(tool_node, ScalarNode) else None
        if not isinstance(tool, str) or not tool:
            nodes.err(tool_node, "mcp.arguments keys must be tool names")
            ok = False
            continue
        if not isinstance(spec, MappingNode):
            nodes.err(spec, f"mcp.arguments.{tool} must map argument names to globs")
            ok = False
            continue
        globs: dict[str, str] = {}
        for arg_node, glob_node in spec.value:
            arg = nodes.scalar(arg_node) if isinstance(arg_node, ScalarNode) else None
            glob = nodes.string(glob_node, f"mcp.arguments.{tool}.{arg}")
            if not isinstance(arg, str) or glob is None or not _glob(nodes, glob_node, glob):
                ok = False
                continue
            globs[arg] = glob
        out[tool] = globs
    return out if ok else None
