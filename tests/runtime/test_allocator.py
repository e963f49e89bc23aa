"""The allocator the gateway's processes run on (gateway/runtime/allocator.py): the
environment chosen (a table), and for real, a Python process started again on the
installed libjemalloc: same pid, jemalloc mapped, its purge answering."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.runtime.allocator import JEMALLOC_CONF, environment, find_jemalloc, without

LIB = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"


@pytest.mark.parametrize(("env", "library", "expected"), [
    ({}, LIB, {"PYTHONMALLOC": "malloc", "LD_PRELOAD": LIB, "MALLOC_CONF": JEMALLOC_CONF}),
    # the operator's choice, or a process already started again: nothing changes
    ({"PYTHONMALLOC": "pymalloc"}, LIB, None),
    ({"PYTHONMALLOC": "malloc"}, LIB, None),
    ({"PYTHONMALLOC": ""}, LIB, None),
    # no libjemalloc installed: CPython's allocator, as before
    ({}, None, None),
    # what the operator preloads stays preloaded, their MALLOC_CONF is kept
    ({"LD_PRELOAD": "/opt/libfoo.so"}, LIB,
     {"PYTHONMALLOC": "malloc", "LD_PRELOAD": f"{LIB} /opt/libfoo.so",
      "MALLOC_CONF": JEMALLOC_CONF}),
    ({"MALLOC_CONF": "narenas:1"}, LIB,
     {"PYTHONMALLOC": "malloc", "LD_PRELOAD": LIB, "MALLOC_CONF": "narenas:1"}),
])
def test_the_environment_chosen(env: dict[str, str], library: str | None,
                                expected: dict[str, str] | None) -> None:
    assert environment(env, lambda: library) == expected


@pytest.mark.parametrize(("env", "library", "expected"), [
    # what `environment` added comes out together: CPython's own allocator
    ({"PYTHONMALLOC": "malloc", "LD_PRELOAD": LIB, "MALLOC_CONF": JEMALLOC_CONF, "A": "1"},
     LIB, {"MALLOC_CONF": JEMALLOC_CONF, "A": "1"}),
    # what else the operator preloads stays
    ({"PYTHONMALLOC": "malloc", "LD_PRELOAD": f"{LIB} /opt/libfoo.so"}, LIB,
     {"LD_PRELOAD": "/opt/libfoo.so"}),
    # not on jemalloc: nothing to take out (PYTHONMALLOC=malloc alone is glibc's malloc)
    ({"PYTHONMALLOC": "malloc"}, LIB, {"PYTHONMALLOC": "malloc"}),
    ({"PYTHONMALLOC": "pymalloc", "LD_PRELOAD": LIB}, LIB,
     {"PYTHONMALLOC": "pymalloc", "LD_PRELOAD": LIB}),
    ({"PYTHONMALLOC": "malloc", "LD_PRELOAD": "/opt/libmimalloc.so"}, LIB,
     {"PYTHONMALLOC": "malloc", "LD_PRELOAD": "/opt/libmimalloc.so"}),
    ({"PYTHONMALLOC": "malloc", "LD_PRELOAD": LIB}, None,
     {"PYTHONMALLOC": "malloc", "LD_PRELOAD": LIB}),
    ({}, LIB, {}),
])
def test_the_environment_without_jemalloc(env: dict[str, str], library: str | None,
                                          expected: dict[str, str]) -> None:
    assert without(env, lambda: library) == expected


def test_the_library_is_found_where_installed(tmp_path: Path) -> None:
    present = tmp_path / "lib" / "libjemalloc.so.2"
    present.parent.mkdir()
    present.write_bytes(b"")
    assert find_jemalloc((str(tmp_path / "none.so"), str(present))) == str(present)
    assert find_jemalloc((str(tmp_path / "none.so"),)) is None


PROBE = """
import json, os, sys
from gateway.runtime import allocator
first = os.environ.get("PROBE_PID")
if first is None:
    os.environ["PROBE_PID"] = str(os.getpid())
    allocator.restart()
print(json.dumps({"pid": os.getpid(), "first": first, "current": allocator.current(),
                  "mapped": "libjemalloc" in open("/proc/self/maps").read(),
                  "purged": allocator.purge(), "argv": sys.argv[1:],
                  "conf": os.environ.get("MALLOC_CONF")}))
"""


def _probe(env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", PROBE, "an-argument"], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    result: dict[str, object] = json.loads(out.stdout)
    return result


@pytest.mark.skipif(find_jemalloc() is None, reason="libjemalloc2 is not installed")
def test_a_process_is_started_again_on_jemalloc() -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONMALLOC", "LD_PRELOAD", "MALLOC_CONF")}
    got = _probe(env)
    assert got["first"] == str(got["pid"])  # (execve: the same process)
    assert got["argv"] == ["an-argument"]
    assert got["current"] == "jemalloc" and got["mapped"] is True and got["purged"] is True
    assert got["conf"] == JEMALLOC_CONF


def test_pythonmalloc_set_keeps_the_process_as_it_is() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    got = _probe({**env, "PYTHONMALLOC": "pymalloc"})
    assert got["first"] is None  # not started again
    assert got["current"] == "pymalloc" and got["mapped"] is False
    assert got["purged"] is False


MIMALLOC = "/usr/lib/x86_64-linux-gnu/libmimalloc.so.2"


@pytest.mark.skipif(not Path(MIMALLOC).is_file(), reason="libmimalloc2.0 is not installed")
def test_an_operators_mimalloc_is_kept_and_purged() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    got = _probe({**env, "PYTHONMALLOC": "malloc", "LD_PRELOAD": MIMALLOC})
    assert got["first"] is None  # PYTHONMALLOC set: not started again
    assert got["current"] == "mimalloc" and got["purged"] is True and got["mapped"] is False
