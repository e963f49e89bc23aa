"""The lock files: complete, hashed, consistent with pyproject.toml, and the only source of
dependencies for `make test` (the Makefile's venv) and the image (the Dockerfile)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
DEV_LOCK = REPO / "requirements-dev.lock"
LOCK = REPO / "requirements.lock"

Pins = dict[str, list[tuple[str, str, int]]]  # name -> [(version, marker, number of hashes)]


def pins(path: Path) -> Pins:
    """Every `name==version [; marker]` entry with the hashes that follow it."""
    out: Pins = {}
    entry: list[str] | None = None
    for raw in [*path.read_text().splitlines(), ""]:
        line = raw.strip()
        if entry is not None and line.startswith("--hash=sha256:"):
            assert re.fullmatch(r"--hash=sha256:[0-9a-f]{64}( \\)?", line), raw
            entry.append(line)
            continue
        if entry is not None:
            head = entry[0].rstrip("\\ ").strip()
            req, _, marker = head.partition(";")
            name, _, version = req.strip().partition("==")
            out.setdefault(canonicalize_name(name), []).append(
                (version.strip(), marker.strip(), len(entry) - 1))
            entry = None
        if line and not line.startswith(("#", "--")):
            entry = [line]
    return out


def project_requirements() -> tuple[list[Requirement], list[Requirement]]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    runtime = [Requirement(r) for r in data["project"]["dependencies"]]
    runtime += [Requirement(r) for r in data["build-system"]["requires"]]
    dev = [Requirement(r) for r in data["project"]["optional-dependencies"]["dev"]]
    return runtime, dev


@pytest.mark.parametrize("path", [DEV_LOCK, LOCK], ids=["dev", "runtime"])
def test_every_entry_is_pinned_and_hashed(path: Path) -> None:
    found = pins(path)
    assert len(found) > 20
    for name, entries in found.items():
        for version, _, hashes in entries:
            assert re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", version), (name, version)
            assert hashes >= 1, f"{path.name}: {name}=={version} has no --hash"


def test_locks_cover_pyproject_and_agree() -> None:
    runtime, dev = project_requirements()
    dev_pins, runtime_pins = pins(DEV_LOCK), pins(LOCK)
    for req, locks in [(r, (dev_pins, runtime_pins)) for r in runtime] + \
            [(r, (dev_pins,)) for r in dev]:
        for lock in locks:
            entries = lock.get(canonicalize_name(req.name))
            assert entries, f"{req.name} is in pyproject.toml but not locked: run `make lock`"
            for version, _, _ in entries:
                assert req.specifier.contains(version, prereleases=True), (
                    f"{req.name}=={version} does not satisfy {req.specifier}: run `make lock`")
    for name, entries in runtime_pins.items():  # the image runs what the tests ran
        assert entries == dev_pins.get(name), f"{name}: requirements.lock differs from -dev"


def test_make_and_the_image_install_only_from_the_locks() -> None:
    makefile = (REPO / "Makefile").read_text()
    stamp = makefile[makefile.index("$(STAMP): "):makefile.index("@touch $@")]
    assert "requirements-dev.lock" in stamp.splitlines()[0]  # a new lock rebuilds the venv
    installs = [i.strip() for i in re.findall(r"pip install ([^|&;\n]*)", stamp)]
    assert installs == ["-q --require-hashes -r requirements-dev.lock",
                        "-q --no-deps --no-build-isolation -e ."], installs
    docker = (REPO / "Dockerfile").read_text()
    assert "pip install --no-cache-dir --require-hashes -r requirements.lock" in docker
    assert len(re.findall(r"pip install", docker)) == 2
