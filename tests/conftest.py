"""Suite-wide setup. Warnings are errors (pyproject.toml). mitmproxy is not imported
here: the gateway registers `mitmproxy.addons` bare (engines/patches.py `lean_packages`)
and loads the addons it uses where it starts the engine, so the suite runs what the
gateway runs (the package's `__init__`, mitmdump's default addons with their
ldap3/pyasn1/flask chain, cost each test process ~0.5 s CPU at collection; nothing
the gateway loads needs it). An unclosed asyncio transport's warning names where
it was made (helpers/transports.py)."""

import pytest
from helpers.schedule import slowest_first
from helpers.transports import record_origins

record_origins()  # (an unclosed transport's warning says where it was made)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest tests first (tests/helpers/schedule.py: why, and their weights)."""
    slowest_first(items)
