"""The package's layout shows the data flow, and the imports keep to it (issue 22, item 5).

Every import statement counts - module level, `TYPE_CHECKING` blocks, function bodies:
an import that only runs later still ties the two modules together.

The loose top-level modules are few and each has a reason: `config.py` (the configuration's
schema and loader) and `config_values.py` (its value readers) are read by every layer;
`errors.py` holds `ConfigError` alone, so that the pure core (`core/durations.py`) and the
policy readers raise it without importing the configuration (issue 41, items 1 and 6);
`lazy.py` is the packages' lazy exports.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

GATEWAY = Path(__file__).resolve().parents[1] / "gateway"

# gateway/<package>: what each holds, in the order data flows through them.
PACKAGES = {
    "cli": "the command line, a module per command group",
    "runtime": "wiring and processes: app, workers, sweeper",
    "api": "the admin API",
    "tools": "operator tools: explain, config check, sandbox env",
    "engines": "ways traffic arrives (front door, HTTP/1, mitmproxy, transparent, DNS)",
    "pipeline": "what engines call: admission, the exchange, asking, signing (stateful)",
    "core": "every decision, pure",
    "services": "what decisions rest on: policy, secrets, minting, metering, identity, state",
    "net": "resolution, pinning, TLS, the CA",
    "observability": "audit trail, metrics, logs",
    "sandbox": "files handed to sandboxes (the Node preload)",
}
LOOSE = {"__init__.py", "__main__.py", "config.py", "config_values.py", "errors.py", "lazy.py",
         "py.typed"}

# Which top-level packages a package may import (besides itself, config, errors and lazy).
MAY_IMPORT = {
    "cli": {"runtime", "api", "tools", "engines", "pipeline", "core", "services", "net",
            "observability"},
    "runtime": {"api", "engines", "pipeline", "core", "services", "net", "observability"},
    "api": {"tools", "core", "services", "net", "observability"},
    "tools": {"core", "services", "net", "observability"},
    "engines": {"pipeline", "core", "services", "net", "observability"},
    "pipeline": {"core"},  # services only through core/ports.py's protocols
    "core": set(),
    "services": {"core", "net", "observability"},
    "net": {"core", "observability"},
    "observability": {"core"},
}


def _name(path: Path) -> str:
    rel = path.relative_to(GATEWAY.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


@cache
def _graph() -> dict[str, set[str]]:
    modules = {_name(p): p for p in GATEWAY.rglob("*.py")}
    # A C extension (`<name>.c`) is a module that imports nothing of the gateway's.
    extensions = {_name(p.with_suffix(".py")) for p in GATEWAY.rglob("*.c")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in [*modules, *extensions]}
    modules.update((name, None) for name in extensions)  # (resolved, not read)
    for module, path in modules.items():
        if path is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                found = resolve(target) if target.startswith("gateway") else None
                if found is not None and found != module:
                    graph[module].add(found)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_the_top_level_holds_packages_not_loose_modules() -> None:
    entries = {p.name for p in GATEWAY.iterdir() if p.name != "__pycache__"}
    packages = {p.name for p in GATEWAY.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert packages == set(PACKAGES)
    assert entries - packages == LOOSE


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_a_package_imports_only_what_lies_below_it(package: str) -> None:
    allowed = {package, "config", "errors", "lazy", "__init__"} | MAY_IMPORT[package]
    wrong = sorted(f"{module} -> {target}" for module, targets in _graph().items()
                   if module.split(".")[1:2] == [package]
                   for target in targets
                   if (target.split(".")[1:2] or ["__init__"])[0] not in allowed)
    assert wrong == []


# -- sizes: small modules, short functions (issue 41, item 2) -----------------------------

MAX_MODULE, MAX_FUNCTION = 400, 80
# Every module of gateway/ over MAX_MODULE lines and every function over MAX_FUNCTION, and
# why it stays whole or what its split waits for (each checked to still be over).
LONG = {
    # the decision (core/)
    "gateway/core/addresses.py": "the address table of every special-purpose range "
    "(IANA registries, conformance data) with its one classifier",
    "gateway/core/mcp.py": "MCP's JSON-RPC read one way: messages, calls, relays and the "
    "tools/list filter share the reader and its limits",
    "gateway/core/metering/endpoints.py": "every provider's endpoints in one table, read "
    "in order (a split would let two tables disagree)",
    "gateway/core/metering/estimate.py": "the bound of every output and input field of "
    "every family, one table",
    "gateway/core/metering/models.py": "every field through which a call reaches a model, "
    "walked by one reader",
    "gateway/core/metering/usage.py": "every family's usage shapes, read by one meter",
    "gateway/core/policy/matcher.py": "the compiled index and its one decision",
    "gateway/core/policy/hosts.py:_compile_wildcard": "one pattern compiler, every glob "
    "form with its error (a table of cases, each a few lines)",
    "gateway/core/policy/matcher.py:_decide_request": "the decision in the order a reader "
    "checks it: deny rules, the first allowing rule, why the others did not match",
    # services and runtime
    "gateway/services/state/counters_redis.py": "the Lua scripts of admission, "
    "settlement and the lease reap beside the Python that packs their arguments and "
    "reads their replies (a split would let a script and its caller disagree)",
    "gateway/services/approvals/__init__.py": "ask mode's one state (the grants this "
    "process holds, the held asks' wake-ups, the approvals and their revisions) shared by "
    "every kind of ask: a held request, an MCP server's consent, a tool's change; its "
    "pure parts are modules (lines, proposal, pins, notify, watch)",
    "gateway/services/metering/service.py:admit": "a call's admission in the order it "
    "is decided (allowlist, budgets, worst case, reservation), each refusal beside its "
    "check; its parts are modules already (exchange, worst_case, refusing)",
    "gateway/services/policy/read_rules.py:read_rule": "each key of a rule in the order "
    "its problems are told, then the Rule with every field named (its docstring)",
    # engines, net, observability, the admin API, configuration
    "gateway/engines/patches.py": "every private API of mitmproxy and h11 the gateway "
    "uses, in the one module that is version-checked (the rule: nowhere else)",
    "gateway/engines/mitm.py": "the mitmproxy adapter: one addon translating every "
    "mitmproxy hook into the gate's calls, with its body streams",
    "gateway/engines/h1/server.py": "the HTTP/1 connection and its exchanges (request, "
    "upstream, response) are one object on the hot path, where a split would add an "
    "indirection per request; framing, sides, the pool and WebSockets are modules",
    "gateway/engines/h1/server.py:_relay_response": "the response of the hot path in one "
    "coroutine: the head (and the one retry), framing, body, trailers and the keep-alive "
    "decision; each part split off would be a coroutine more per request",
    "gateway/net/resolver.py": "the destination guard and the event loop's backstop that "
    "enforces it on every dial (pins, proxy hops, the unguarded store clients) share "
    "one state and must not drift apart",
    "gateway/observability/audit.py": "the sink's one state machine: the held lines, the "
    "spill journal and the target's health change together in each loop tick (the "
    "targets and the journal are modules: audit_out, audit_spill)",
    "gateway/observability/metrics.py": "every Prometheus metric the gateway exports, "
    "defined in one place (names, labels and help text read together)",
    "gateway/api/console/requests.py:routes": "the request log's pages and live stream "
    "share their filters and the hold, defined together",
    "gateway/config.py": "the configuration as one typed schema (a msgspec structure a "
    "section), with the key walk the chart's schema and docs are checked against",
    "gateway/config_values.py": "every configuration value's coercer with its message, "
    "one table (a split would scatter the messages)",
}


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    modules: dict[str, int] = {}
    functions: dict[str, int] = {}
    for path in sorted(GATEWAY.rglob("*.py")):
        name = path.relative_to(GATEWAY.parent).as_posix()
        text = path.read_text()
        modules[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                functions[f"{name}:{node.name}"] = node.end_lineno - node.lineno + 1
    return modules, functions


def test_modules_and_functions_are_small_or_say_why() -> None:
    modules, functions = _sizes()
    over = sorted([m for m, n in modules.items() if n > MAX_MODULE] +
                  [f for f, n in functions.items() if n > MAX_FUNCTION])
    assert [o for o in over if o not in LONG] == [], "split them, or say why in LONG"
    assert [k for k in LONG if k not in over] == [], "no longer long: remove from LONG"
