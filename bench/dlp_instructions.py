"""Outbound credential detection, on against off, in instructions (issue 43; ``python -m
bench --only dlp_instructions``): each POST workload through a gateway under valgrind's
callgrind (`bench.instructions`), to the rule without `dlp:` and to the rule with it,
counting the worker's user-space instructions a request.

Why this is the reading the issue's target judges: the CPU time of the same workload on
this project's 2-vCPU VM moved 2x within one run (a 2 KB POST 444-1,100 µs, a 1 MiB one
1.9-4.3 ms a MiB, 2026-12-01 19:01Z), and sixteen alternating rounds' medians of the same
code read 1.01x-1.14x for the upload over seven runs: a 5 % bound cannot be decided by
time here (`dlp_rounds` still runs, beside this, informational). An instruction count is
the same from run to run, and it overstates detection's share: the kernel's work (socket
copies, a quarter to a third of an upload's CPU) is the same with and without and is not
in the denominator, and the gate's vector pass (AVX2's under valgrind, not the AVX-512
pass this host runs) retires several instructions a cycle where Python's work takes
several cycles an instruction. What it does not see: caches (detection's window keeps
no copy of a piece it lets go, docs/performance.md). ~40 s a count, eight counts.
"""

from __future__ import annotations

from typing import Any

from bench import instructions

MIB = 1 << 20
# (workload, --body bytes, --agent): the POST rows' workloads; the upload as 4 MiB of
# JSON, past the hold limit (streamed, as the 100 MiB upload is: a few requests under
# callgrind in the window)
WORKLOADS = (("post_2k", 2_000, False), ("post_1m", MIB, False),
             ("upload", 4 * MIB, False), ("post_agent", MIB, True))


def run(seconds: float) -> dict[str, Any]:
    """Per workload: the instructions a request without (`off`) and with (`on`)
    detection, and their ratio; `error` in a workload where one could not be counted
    (no valgrind, a failed warm-up)."""
    found: dict[str, Any] = {"seconds": seconds}
    for workload, body, agent in WORKLOADS:
        try:
            pair = {key: instructions.measure(row, seconds, 0, body=body, agent=agent)
                    ["instructions_per_request"]
                    for key, row in (("off", "post"), ("on", "post_dlp"))}
        except SystemExit as exc:  # (measure's way of saying why it could not count)
            found[workload] = {"error": str(exc)[:800]}
            continue
        found[workload] = {**pair, "ratio": pair["on"] / pair["off"]}
    return found
