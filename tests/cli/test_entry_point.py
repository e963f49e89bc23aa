"""The command's entry point (gateway/__main__.py): which command lines are `run`, the
one command started again on jemalloc (a real gateway on it:
tests/reliability/test_memory_burst.py)."""

from __future__ import annotations

import pytest

from gateway.__main__ import command_of


@pytest.mark.parametrize(("argv", "command"), [
    (["run"], "run"),
    (["run", "--workers", "2"], "run"),
    (["--config", "gw.yaml", "run"], "run"),
    (["--config", "run", "token", "mint"], "token"),  # (a config file named run)
    (["--config=gw.yaml", "run"], "run"),
    (["token", "mint", "--sandbox", "run"], "token"),
    (["--version"], None),
    ([], None),
])
def test_the_command_of_a_command_line(argv: list[str], command: str | None) -> None:
    assert command_of(argv) == command
