"""The vendored conformance copy must equal the shared source of truth when present."""

import pytest
from conformance import SHARED, VENDORED


def test_vendored_copy_matches_shared() -> None:
    if not SHARED.exists():
        pytest.skip(f"{SHARED} not beside this checkout; the vendored copy is used")
    assert VENDORED.read_bytes() == SHARED.read_bytes(), (
        f"tests/data/egress_cases.yaml is stale: cp {SHARED} {VENDORED}")
