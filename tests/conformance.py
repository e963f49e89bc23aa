"""Where the conformance data lives: `../shared/conformance/egress_cases.yaml` beside the
repository (the source of truth), else the copy in tests/data (kept identical: see
tests/test_conformance_copy.py), so the conformance tests always run."""

from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
SHARED = _REPO.parent / "shared" / "conformance" / "egress_cases.yaml"
VENDORED = _REPO / "tests" / "data" / "egress_cases.yaml"
CASES_FILE = SHARED if SHARED.exists() else VENDORED
