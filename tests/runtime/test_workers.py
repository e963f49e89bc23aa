"""Worker count: affinity capped by the cgroup v2 CPU quota."""

from pathlib import Path

import pytest

from gateway.runtime.workers import available_cpus


@pytest.mark.parametrize(("cpu_max", "cap"), [
    ("max 100000\n", None), ("200000 100000\n", 2), ("150000 100000\n", 2),
    ("50000 100000\n", 1), ("garbage", None),
])
def test_available_cpus_honours_the_cgroup_quota(tmp_path: Path, cpu_max: str,
                                                 cap: int | None) -> None:
    import os

    path = tmp_path / "cpu.max"
    path.write_text(cpu_max)
    cpus = len(os.sched_getaffinity(0))
    assert available_cpus(path) == (cpus if cap is None else min(cpus, cap))


def test_no_cgroup_file_means_affinity(tmp_path: Path) -> None:
    import os

    assert available_cpus(tmp_path / "missing") == len(os.sched_getaffinity(0))
