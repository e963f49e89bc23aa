"""The core is pure: it imports no engine library (mitmproxy, h11, asyncio networking)."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "gateway" / "core"
FORBIDDEN = ("mitmproxy", "h11", "h2", "wsproto", "gateway.engines", "gateway.net",
             "socket", "ssl", "asyncio", "aiohttp", "starlette", "uvicorn")


def test_no_engine_imports_in_the_core() -> None:
    found = []
    for path in sorted(CORE.rglob("*.py")):  # with subpackages (core/dlp)
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.split(".")[0] in FORBIDDEN or name.startswith(FORBIDDEN):
                    found.append(f"{path.name}: {name}")
    assert not found, found


# -- transitively -------------------------------------------------------------------------

GATEWAY = CORE.parent
# What the core may not reach through any chain of module-level imports: I/O, engines,
# token and TLS machinery, stores, files and configuration.
FORBIDDEN_ANYWHERE = (*FORBIDDEN, "jwt", "cryptography", "yaml", "subprocess", "fcntl",
                      "sqlite3", "redis", "dns", "botocore", "google", "azure", "http",
                      "urllib3", "gateway.config", "gateway.net.ca",
                      "gateway.services.identity.tokens", "gateway.runtime.app",
                      "gateway.services.policy.loader", "gateway.services.policy.reloader",
                      "gateway.services.secrets.cache", "gateway.services.secrets.factory",
                      "prometheus_client", "gateway.observability")
# Known impurities, not followed further (none left: telemetry is the `Telemetry` port of
# core/ports.py, which observability/metrics.py implements). An entry names a module the
# core still reaches and why.
KNOWN: dict[str, str] = {}


def _module_file(name: str) -> Path | None:
    path = GATEWAY.parent.joinpath(*name.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def _imports_at_import_time(name: str, path: Path) -> set[str]:
    """Modules `name` imports when it is imported: module level, `TYPE_CHECKING` blocks
    and function bodies left out; `from package import submodule` counted."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    todo: list[ast.AST] = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names
                         if _module_file(f"{base}.{a.name}") is not None)
        else:
            todo.extend(ast.iter_child_nodes(node))
    return found


def _closure() -> tuple[set[str], set[str]]:
    """(gateway modules, other modules) the core's import reaches."""
    todo = [".".join(("gateway", "core", *p.relative_to(CORE).with_suffix("").parts))
            for p in CORE.rglob("*.py") if p.stem != "__init__"]
    seen: set[str] = set()
    others: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if not name.startswith("gateway"):
            others.add(name)
            continue
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # parents run first
        path = _module_file(name)
        if path is None or name in KNOWN:
            continue
        todo.extend(_imports_at_import_time(name, path))
    return {n for n in seen if n.startswith("gateway")}, others


def test_the_core_is_pure_through_every_import_chain() -> None:
    ours, others = _closure()
    reached = ours | others
    bad = sorted(n for n in reached if n.split(".")[0] in FORBIDDEN_ANYWHERE
                 or n.startswith(FORBIDDEN_ANYWHERE))
    assert not bad, f"the core reaches {bad} (through module-level imports)"
    stale = sorted(k for k in KNOWN if k not in ours)
    assert not stale, f"{stale} no longer reached: remove them from KNOWN"


def test_the_walk_sees_what_python_imports() -> None:
    """The AST walk is no weaker than the interpreter: what importing the core loads
    (in a fresh interpreter) is within what the walk reached, plus what the known
    impurities bring."""
    import subprocess
    import sys

    code = ("import sys, pkgutil, importlib, gateway.core as c\n"
            "for m in pkgutil.walk_packages(c.__path__, 'gateway.core.'): "
            "importlib.import_module(m.name)\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('gateway'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=GATEWAY.parent).stdout.split()
    ours, _ = _closure()
    assert set(out) <= ours, sorted(set(out) - ours)
