"""Outbound credential detection on a streamed upload, on against off in alternating rounds
(issue 43; ``python -m bench --only dlp_rounds``): one gateway takes the upload of
`upload_bytes` of prose to the rule without `dlp:` and to the rule with it in turn (the
POST rows' hosts), in AB BA order.

The POST rows measure the upload without detection minutes before the one with it; a
shared machine's load moves CPU per MiB by 10-20 % in that time, more than the 5 % the
issue allows detection. Here each round's two uploads are seconds apart, in one process,
and every round gives a ratio; the median of the rounds' ratios is what the target judges
(as `pass_rounds` and `otel_rounds` do).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.__main__ import Bench, Row

MIB = 1 << 20


def run(bench: Bench, rows: tuple[Row, Row], rounds: int) -> dict[str, Any]:
    """Per round: ms of proxy CPU per MiB of the upload without (`off`) and with (`on`)
    detection, and their ratio; the median. `rows`: the POST rows, off then on."""
    proxy = bench.make_proxy("gateway", "dlp-rounds")
    turns: list[dict[str, float]] = []
    try:
        proxy.start()
        for n in range(rounds):
            turn: dict[str, float] = {}
            order = list(zip(("off", "on"), rows, strict=True))
            for key, row in order if n % 2 == 0 else order[::-1]:
                res = bench.client(bench.spec(row, "upload", proxy), proxy,
                                   bench.timeout("upload"))
                if res.get("status") != 200 or not res.get("bytes"):
                    raise RuntimeError(f"{row.key}: {res.get('error') or res.get('status')}")
                turn[key] = res["proxy_cpu_s"] * 1e3 / (res["bytes"] / MIB)
            turns.append(turn)
    finally:
        proxy.stop()
    ratios = [t["on"] / t["off"] for t in turns]
    return {"rounds": rounds, "mib": bench.sizes.upload_bytes / MIB, "turns": turns,
            "ratios": ratios, "median": statistics.median(ratios)}
