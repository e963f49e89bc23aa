"""The suite's order (tests/helpers/schedule.py): the slowest tests are collected first,
heaviest first, the others in pytest's order; no weight names a test that is gone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.schedule import SECONDS, stale

ROOT = Path(__file__).resolve().parent.parent


def test_every_weight_names_a_test_that_exists() -> None:
    assert stale(ROOT) == []


def test_the_slowest_are_collected_first_and_the_rest_keep_their_order() -> None:
    paths = ["tests/reliability/test_state_outage.py", "tests/reliability/test_soak.py",
             "tests/test_bench_smoke.py", "tests/reliability/test_tunnel_audit.py"]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *paths], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    ids = [line for line in out.splitlines() if "::" in line]
    soak, bench = (next(t for t in SECONDS if name in t) for name in ("test_soak", "bench"))
    assert ids[:2] == sorted([soak, bench], key=SECONDS.__getitem__, reverse=True)
    # (listed: by their weight)
    # then the ones marked slow that are not listed, in their order, then the rest
    assert [i.split("::")[0] for i in ids[2:5]] == ["tests/reliability/test_state_outage.py"] * 3
    rest = ids[5:]
    assert rest and all(i.startswith("tests/reliability/test_tunnel_audit.py") for i in rest)
    source = (ROOT / "tests/reliability/test_tunnel_audit.py").read_text()
    defined = [source.index(f"def {i.split('::')[1].split('[')[0]}(") for i in rest]
    assert defined == sorted(defined)  # (as written in the file)
