"""Suite-wide setup. Warnings are errors (pyproject.toml). mitmproxy is not imported
here: the gateway registers `mitmproxy.addons` bare (engines/patches.py `lean_packages`)
and loads the addons it uses where it starts the engine, so the suite runs what the
gateway runs (the package's `__init__`, mitmdump's default addons with their
ldap3/pyasn1/flask chain, cost each test process ~0.5 s CPU at collection; nothing
the gateway loads needs it). An unclosed asyncio transport's warning names where
it was made (helpers/transports.py).

The suite's Python processes keep their bytecode even where the environment says not to
(`PYTHONDONTWRITEBYTECODE`, set on some machines and CI images): without it every
`sandbox-gateway run` a test starts compiles the gateway's ~300 modules from source
again (1.3 s of CPU each, measured; hundreds of such processes a run), and each xdist
worker rewrites every test module's asserts again at collection (most of its ~24 s of
CPU there; pytest keeps the rewritten modules in `__pycache__` only when it may write).
Set here, before the workers and any subprocess start, so they inherit it."""

import os
import sys

import pytest
from helpers.schedule import slowest_first
from helpers.transports import record_origins

record_origins()  # (an unclosed transport's warning says where it was made)
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # (the module docstring says why)
sys.dont_write_bytecode = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest tests first (tests/helpers/schedule.py: why, and their weights)."""
    slowest_first(items)
