"""A C extension built with AddressSanitizer and UBSan, and a script run against it in a
child process where every Python allocation is its own (PYTHONMALLOC=malloc: a red zone
right after each buffer), so a read or write past a buffer stops the run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest


def run_sanitized(source: Path, tmp_path: Path, script: str, *args: str,
                  timeout: float = 300) -> str:
    """Builds `source` sanitized into `tmp_path`, runs `script` with the built module's
    path and `args` as its arguments; returns its output (the test fails on a sanitizer
    report or an exit other than 0; skips where gcc or its sanitizer runtimes are not)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc")
    runtime = [subprocess.run([gcc, f"-print-file-name={lib}"], capture_output=True,
                              text=True, check=True).stdout.strip()
               for lib in ("libasan.so", "libubsan.so")]
    if not all(Path(lib).is_file() for lib in runtime):
        pytest.skip("no libasan/libubsan")
    built = tmp_path / f"{source.stem}.so"
    subprocess.run([gcc, "-O1", "-g", "-fsanitize=address,undefined", "-shared", "-fPIC",
                    f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(built)],
                   check=True)
    run = subprocess.run([sys.executable, "-c", script, str(built), *args],
                         capture_output=True, text=True, timeout=timeout, env={
                             **os.environ, "PYTHONMALLOC": "malloc",
                             "ASAN_OPTIONS": "detect_leaks=0",
                             "UBSAN_OPTIONS": "halt_on_error=1",
                             "LD_PRELOAD": " ".join(runtime)})
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout
