"""The `Detectors` port (services/dlp/detectors.py): the salt file, made once and kept,
and the detectors built only when asked for."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.core.dlp import DETECTORS
from gateway.services.dlp.detectors import SALT_BYTES, LazyDetectors, ensure_salt


def test_the_salt_is_made_once_private_and_then_read(tmp_path: Path) -> None:
    path = tmp_path / "certs" / "dlp-salt"
    first = ensure_salt(path)
    assert len(first) == SALT_BYTES and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_salt(path) == first
    assert ensure_salt(tmp_path / "other") != first  # (another deployment, another salt)


def test_a_salt_too_short_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "dlp-salt"
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="fewer than 16 bytes"):
        ensure_salt(path)


def test_the_scanner_is_built_once_with_every_detector() -> None:
    detectors = LazyDetectors(b"s" * 32, 1 << 20)
    assert not detectors.built
    scanner = detectors.scanner()
    assert detectors.built and detectors.scanner() is scanner
    assert {d.name for d in scanner.detectors} == set(DETECTORS)
    assert (scanner.salt, scanner.limit) == (b"s" * 32, 1 << 20)


def test_constructing_the_port_does_not_import_the_library() -> None:
    code = ("import sys\nfrom gateway.services.dlp.detectors import LazyDetectors\n"
            "LazyDetectors(b'x' * 32, 1)\n"
            "print('detect_secrets' in sys.modules, 'requests' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.split() == ["False", "False"]


def test_building_the_scanner_leaves_requests_unimported_until_a_plugin_reads_it() -> None:
    """detect-secrets' plugins import `requests` for their verify calls: the scanner is
    built (and finds a key) without it; a plugin's first read of it gets the real package,
    and a later `import requests` is the real one too."""
    code = ("import sys\nfrom gateway.services.dlp.detectors import LazyDetectors\n"
            "s = LazyDetectors(b'x' * 32, 1 << 20).scanner()\n"
            "from gateway.core.dlp import Location\n"
            "found = s.scan_text('key ghp_' + 'A1b2C3d4E5' * 3 + 'abcdef', Location('body'))\n"
            "print(bool(found), 'requests' in sys.modules, 'urllib3' in sys.modules)\n"
            "import requests, detect_secrets.plugins.base as base\n"
            "print(base.requests.exceptions.RequestException is "
            "requests.exceptions.RequestException, type(requests.get).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.split() == ["True", "False", "False", "True", "function"]


def test_processes_starting_together_agree_on_one_whole_salt(tmp_path: Path) -> None:
    """Workers start together: each either makes the salt or reads the one another made,
    never a file created but not yet written (a worker failed to start on that).

    One pool of 8 processes for every round, each call let go by a barrier of 8 so
    they race on the fresh path at once: 200 rounds in about a second. (A pool forked
    per round took 23 s of a suite run for 30 rounds, forking a test worker's whole
    address space 240 times, and a create-then-write salt failed about one run in two;
    with the barrier every run of 200 rounds failed it, 3-14 rounds each.)"""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    with context.Pool(8, initializer=_gate, initargs=(context.Barrier(8),)) as pool:
        for round_ in range(200):
            path = tmp_path / f"r{round_}" / "dlp-salt"
            salts = pool.map(_salt_of, [path] * 32, chunksize=1)
            assert len(set(salts)) == 1 and len(salts[0]) == 32
            assert sorted(p.name for p in path.parent.iterdir()) == ["dlp-salt"]  # no temp
            assert path.stat().st_mode & 0o777 == 0o600


_BARRIER: list[Any] = []  # (in each pool process: the barrier its calls wait on)


def _gate(barrier: Any) -> None:
    _BARRIER.append(barrier)


def _salt_of(path: Path) -> bytes:
    _BARRIER[0].wait(30)
    return ensure_salt(path)
