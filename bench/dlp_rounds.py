"""Outbound credential detection, on against off in alternating rounds (issue 43;
``python -m bench --only dlp_rounds``): one gateway takes each of the POST rows' three
workloads (a 2 KB JSON POST for a few seconds, the same of 1 MiB bodies, a coding agent's
chat request as the OpenAI SDK sends one (bench/agent.py), one streamed upload of
`upload_bytes`) to the rule without `dlp:` and to the rule with it in turn (the
POST rows' hosts), in AB BA order.

The POST rows measure each workload without detection minutes before the one with it; a
machine's load moves CPU per request by 5-20 % in that time (±5 % from run to run on a
quiet 2-vCPU VM, measured), as much as the 5 % the issue allows detection. Here each
round's two runs of a workload are seconds apart, in one process, and every round gives
a ratio; the median of the rounds' ratios is what the target judges (as `pass_rounds`
and `otel_rounds` do). The upload's figures stay at the top level of the result.

Sixteen short rounds, not six long ones (twenty-third session): on this project's
2-vCPU VM one round's ratio spread 0.78-1.74x for the upload and 0.94-1.39x for the
others on a busy day, and six rounds' medians moved between 1.00x and 1.28x from run to
run for a cost that 40 alternating pairs of uploads put at 1.022x (the sum of their CPU)
and one process at ~2 %. The median of more rounds is what moves less.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from bench.report import derive

if TYPE_CHECKING:
    from bench.__main__ import Bench, Row

MIB = 1 << 20
# (workload, the figure compared: CPU per request or per MiB, runs a turn averages: an
# upload takes ~0.2 s, and one upload's CPU per MiB moves by ±8 % from the next one's)
WORKLOADS = (("post_2k", "proxy_cpu_us_per_req", 1), ("post_1m", "proxy_cpu_ms_per_mib", 1),
             ("post_agent", "proxy_cpu_us_per_req", 1), ("upload", "proxy_cpu_ms_per_mib", 2))


def run(bench: Bench, rows: tuple[Row, Row], rounds: int,
        seconds: float = 1.5) -> dict[str, Any]:
    """Per round and workload: the proxy's CPU without (`off`) and with (`on`) detection,
    and their ratio; the medians. `rows`: the POST rows, off then on; `seconds`: each
    run of a POST workload."""
    proxy = bench.make_proxy("gateway", "dlp-rounds")
    turns: dict[str, list[dict[str, float]]] = {w: [] for w, _, _ in WORKLOADS}
    try:
        proxy.start()
        for n in range(rounds):
            for workload, field, runs in WORKLOADS:
                turn: dict[str, float] = {}
                order = list(zip(("off", "on"), rows, strict=True))
                for key, row in order if n % 2 == 0 else order[::-1]:
                    spec = bench.spec(row, workload, proxy)
                    if "duration" in spec:
                        spec["duration"] = seconds
                    figures = []
                    for _ in range(runs):
                        res = bench.client(spec, proxy, bench.timeout(workload))
                        derive(workload, res)
                        if field not in res or res.get("error") or res.get("warning"):
                            raise RuntimeError(f"{row.key}/{workload}: "
                                               f"{res.get('error') or res.get('warning')}")
                        figures.append(res[field])
                    turn[key] = statistics.fmean(figures)
                turns[workload].append(turn)
    finally:
        proxy.stop()
    found: dict[str, Any] = {"rounds": rounds, "mib": bench.sizes.upload_bytes / MIB,
                             "seconds": seconds}
    for workload, _, _ in WORKLOADS:
        ratios = [t["on"] / t["off"] for t in turns[workload]]
        part = {"turns": turns[workload], "ratios": ratios,
                "median": statistics.median(ratios)}
        if workload == "upload":
            found.update(part)
        else:
            found[workload] = part
    return found
