"""`python -m gateway` is the `sandbox-gateway` command (`main`, its entry point too).

`run` is first started again on the allocator its processes should have
(`runtime/allocator.py`: jemalloc where installed), before the CLI and the gateway are
imported: the interpreter takes its allocator when it starts, and importing the CLI
twice would cost seconds on a busy machine."""

from __future__ import annotations

import sys

__all__ = ["command_of", "main"]


def command_of(argv: list[str]) -> str | None:
    """The subcommand of a `sandbox-gateway` command line (the first argument that is not
    an option or `--config`'s value), or None."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--config":
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


def main() -> int:
    run = command_of(sys.argv[1:]) == "run"
    if run:
        from gateway.runtime.allocator import restart

        restart()  # (returns when already on it, told otherwise, or without jemalloc)
        from gateway.engines.patches import lean_dependencies

        lean_dependencies()  # (uvicorn, prometheus_client, PyJWT without their extras)
    from gateway.cli import GROUPS
    from gateway.cli import main as cli_main

    # `run` knows only its own command: a gateway process holds no other command's modules
    return cli_main(groups=("run",) if run else GROUPS)


if __name__ == "__main__":
    raise SystemExit(main())
