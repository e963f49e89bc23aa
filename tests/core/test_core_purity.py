"""The core is pure: it imports no engine library (mitmproxy, h11, asyncio networking)."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "gateway" / "core"
FORBIDDEN = ("mitmproxy", "h11", "h2", "wsproto", "gateway.engines", "gateway.net",
             "socket", "ssl", "asyncio", "aiohttp", "starlette", "uvicorn")


def test_no_engine_imports_in_the_core() -> None:
    found = []
    for path in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.split(".")[0] in FORBIDDEN or name.startswith(FORBIDDEN):
                    found.append(f"{path.name}: {name}")
    assert not found, found
