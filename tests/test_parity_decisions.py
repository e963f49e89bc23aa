"""The parity suite's cross-engine comparison holds under pytest-xdist: each engine's
decision for a case is kept where every process of the run reads it
(tests/helpers/parity.py `SharedDecisions`), so two engines of one case that ran in two
processes are still compared (a module-level dict compared only rows that happened to
share a process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.parity import SharedDecisions

ROOT = Path(__file__).resolve().parents[1]


def test_two_processes_see_each_other(tmp_path: Path) -> None:
    first, second = SharedDecisions(tmp_path / "run"), SharedDecisions(tmp_path / "run")
    assert first.record("a.b/c", "h1", {"decision": "deny"}) == {"h1": {"decision": "deny"}}
    seen = second.record("a.b/c", "mitmproxy", {"decision": "allow"})
    assert seen == {"h1": {"decision": "deny"}, "mitmproxy": {"decision": "allow"}}
    assert second.record("a.b", "h1", {}) == {"h1": {}}  # (a case whose name is a prefix)


def test_a_disagreement_across_xdist_workers_fails_the_case(tmp_path: Path) -> None:
    """Two engines of one case forced onto two worker processes, deciding differently:
    the case fails (it passed when each process compared only its own rows)."""
    module = tmp_path / "test_split.py"
    module.write_text('''
import pytest
from helpers.parity import shared_decisions

@pytest.fixture(scope="session")
def decisions(request, tmp_path_factory):
    return shared_decisions(request.config, tmp_path_factory.getbasetemp(), "t")

@pytest.mark.parametrize("engine", [
    pytest.param("h1", marks=pytest.mark.xdist_group("one")),
    pytest.param("mitmproxy", marks=pytest.mark.xdist_group("two"))])
def test_case(engine, decisions, tmp_path_factory):
    import os, time
    (tmp_path_factory.getbasetemp().parent.parent / f"worker-{engine}").write_text(
        os.environ["PYTEST_XDIST_WORKER"])
    if engine == "mitmproxy":
        time.sleep(1)  # (after the other process wrote its answer)
    seen = decisions.record("case", engine, {"decision": engine})
    assert len({str(v) for v in seen.values()}) == 1, seen
''')
    base = tmp_path / "base"
    base.mkdir()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-n", "2", "--dist", "loadgroup", str(module),
                          "--basetemp", str(base / "t"), "--rootdir", str(tmp_path),
                          "-c", "/dev/null", "-o", f"pythonpath={ROOT / 'tests'} {ROOT}"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    workers = {(base / f"worker-{e}").read_text() for e in ("h1", "mitmproxy")}
    assert len(workers) == 2, workers  # (the two engines ran in two processes)
    assert "1 failed, 1 passed" in run.stdout, run.stdout + run.stderr
