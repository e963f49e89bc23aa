"""Names a package exports but imports only on first use (PEP 562 `__getattr__`).

A package whose heavier modules (files, YAML, asyncio, an SDK) serve only some of its
users keeps them out of the others' imports: the enforcement core imports the policy
model and a secret's value type without the loader, the stores or the cache.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, where: Mapping[str, str],
               namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `where` maps a name to the submodule that
    defines it; the first use imports it and keeps the name in `namespace`."""
    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value
    return __getattr__
