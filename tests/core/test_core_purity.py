"""The core is the decision and nothing else (issue 41, item 1): no I/O, no asyncio, no
imports from services, config, engines, pipeline or runtime.

Every import statement counts - module level, ``TYPE_CHECKING`` blocks, function bodies:
an ``import sqlite3`` inside a core function is as much an impurity as one at the top.
The walk follows every module the core reaches, through every chain.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "gateway" / "core"
GATEWAY = CORE.parent
# What the core may not reach through any chain of imports: engines and networking,
# I/O, token and TLS machinery, stores, files, configuration and the layers above it.
FORBIDDEN = ("mitmproxy", "h11", "h2", "wsproto", "socket", "ssl", "asyncio", "aiohttp",
             "starlette", "uvicorn", "jwt", "cryptography", "yaml", "subprocess", "fcntl",
             "sqlite3", "redis", "dns", "botocore", "google", "azure", "http", "urllib3",
             "prometheus_client", "os", "pathlib", "shutil", "tempfile", "select",
             "selectors", "threading", "multiprocessing", "signal", "logging",
             "importlib.resources", "gateway.config", "gateway.services", "gateway.engines",
             "gateway.net", "gateway.pipeline", "gateway.runtime", "gateway.api",
             "gateway.cli", "gateway.tools", "gateway.observability")
# Known impurities: a module the core still reaches, and why (checked to still be
# reached, so an entry goes when its reason does).
KNOWN: dict[str, str] = {
    "logging": "core/metering/usage.py logs (never raises) an answer it cannot read; "
               "the meter goes on without its usage",
}


def _module_file(name: str) -> Path | None:
    path = GATEWAY.parent.joinpath(*name.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def _extension(name: str) -> bool:
    """Whether ``name`` is a C extension of the gateway's (built from ``<name>.c``: the
    core's `dlp/_gate.c` computes over a buffer and imports nothing)."""
    return GATEWAY.parent.joinpath(*name.split(".")).with_suffix(".c").is_file()


def imports_of(name: str, source: str, is_package: bool) -> set[str]:
    """Every module ``source`` (module ``name``) imports, wherever the statement is;
    ``from package import submodule`` counted as the submodule."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names
                         if _module_file(f"{base}.{a.name}") is not None
                         or _extension(f"{base}.{a.name}"))
    return found


def _core_modules() -> list[str]:
    return [".".join(p.relative_to(GATEWAY.parent).with_suffix("").parts[:-1]
                     if p.name == "__init__.py" else
                     p.relative_to(GATEWAY.parent).with_suffix("").parts)
            for p in sorted(CORE.rglob("*.py"))]


def closure(extra: dict[str, str] | None = None) -> tuple[set[str], set[str]]:
    """(gateway modules, other modules) the core reaches; ``extra``: module name to
    source, replacing a module's file (the mutation test)."""
    todo = _core_modules()
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if not name.startswith("gateway"):
            continue
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # parents run first
        path = _module_file(name)
        if path is None:
            continue
        source = (extra or {}).get(name, path.read_text())
        todo.extend(imports_of(name, source, path.name == "__init__.py"))
    return ({n for n in seen if n.startswith("gateway")},
            {n for n in seen if not n.startswith("gateway")})


def impurities(extra: dict[str, str] | None = None) -> list[str]:
    ours, others = closure(extra)
    return sorted(n for n in ours | others
                  if (n.split(".")[0] in FORBIDDEN or n.startswith(FORBIDDEN))
                  and n not in KNOWN)


def test_the_core_is_pure_through_every_import_chain() -> None:
    bad = impurities()
    assert not bad, f"the core reaches {bad}"
    ours, others = closure()
    stale = sorted(k for k in KNOWN if k not in ours | others)
    assert not stale, f"{stale} no longer reached: remove them from KNOWN"


MUTATIONS = [
    ("an import inside a function", "gateway.core.names",
     "def f() -> None:\n    import sqlite3\n", "sqlite3"),
    ("a TYPE_CHECKING import", "gateway.core.names",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gateway.config import Config\n",
     "gateway.config"),
    ("a service", "gateway.core.policy.model",
     "from gateway.services.metering import Metering\n", "gateway.services.metering"),
    ("the pipeline, from a subpackage", "gateway.core.metering.estimate",
     "def g() -> None:\n    from gateway.pipeline import gate\n", "gateway.pipeline"),
    ("asyncio through a relative import", "gateway.core.refusal",
     "async def h() -> None:\n    import asyncio.events\n", "asyncio.events"),
]


@pytest.mark.parametrize(("what", "module", "added", "caught"), MUTATIONS,
                         ids=[m[0] for m in MUTATIONS])
def test_the_check_fails_on_a_mutation(what: str, module: str, added: str,
                                       caught: str) -> None:
    path = _module_file(module)
    assert path is not None
    bad = impurities({module: path.read_text() + "\n" + added})
    assert caught in bad, (what, bad)


def test_the_walk_sees_what_python_imports() -> None:
    """The AST walk is no weaker than the interpreter: what importing the core loads
    (in a fresh interpreter) is within what the walk reached."""
    code = ("import sys, importlib\n"
            f"for m in {_core_modules()!r}: importlib.import_module(m)\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('gateway'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=GATEWAY.parent).stdout.split()
    ours, _ = closure()
    assert set(out) <= ours, sorted(set(out) - ours)
