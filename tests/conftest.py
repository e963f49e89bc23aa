"""Suite-wide setup. Warnings are errors (pyproject.toml); third-party modules that warn
at import time (mitmproxy's ldap3/pyasn1/pyparsing chain) are imported once here with
their import-time warnings silenced, so the warnings that remain are ours to fix; an
unclosed asyncio transport's warning names where it was made (helpers/transports.py)."""

import warnings

import pytest
from helpers.schedule import slowest_first
from helpers.transports import record_origins

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import mitmproxy.addons
    import mitmproxy.flowfilter  # noqa: F401

record_origins()  # (an unclosed transport's warning says where it was made)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest tests first (tests/helpers/schedule.py: why, and their weights)."""
    slowest_first(items)
