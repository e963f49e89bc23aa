"""The commands the console shows for an operator to paste (one place builds them all).

Every argument is quoted for a POSIX shell (`shlex.join`), so what a sandbox chose (a
path with `$(...)`, `;`, quotes or newlines, a method) is one argument, never shell
syntax; values a sandbox chose come after `--` or as `--option=value`, so none is read as
an option. Pages show the command as text (the templates escape it).
"""

from __future__ import annotations

import shlex

__all__ = ["explain_command", "shell"]


def shell(*argv: str) -> str:
    """`argv` as one line a POSIX shell splits back into exactly `argv`."""
    return shlex.join(argv)


def explain_command(policy: str, method: str, url: str) -> str:
    """`policy explain` of one request, as the CLI takes it."""
    return shell("sandbox-gateway", "policy", "explain", f"--policy={policy}", "--",
                 method, url)
