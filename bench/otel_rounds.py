"""The OTLP export's cost in alternating rounds (issue 45; ``python -m bench --only
otel_rounds``): the export-off gateway and the two export rows' gateways (a span per
request; a span and a log record) run at once, pinned to the gateway's core, and take
short turns of intercepted GETs (c10), in ABC CBA order, for `rounds` rounds.

The ``gateway_otel*`` rows measure the export minutes after the export-off row; the
worker's CPU per request drifts by 10-20 % in that time on a shared machine (other
work comes and goes), more than the export costs. Here each round's three turns are
seconds apart, every round gives a ratio of each export gateway to the export-off one
(CPU per request of the whole process tree, worker and exporter, and of the worker
alone), and the median of the rounds' ratios is what the targets judge. Idle gateways
waiting for their turn cost next to nothing (their timers). A turn's CPU is read once
the exporter sent what the turn's requests made (`Sizes.otel_settle` after the
load), for the export-off gateway too.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.__main__ import Bench, Row

GATEWAYS = ("gateway", "gateway_otel", "gateway_otel_logs")  # off, spans, spans + logs


def run(bench: Bench, row: Row, rounds: int, seconds: float,
        settle: float) -> dict[str, Any]:
    """Per round and gateway: µs of CPU per request (tree, worker); the rounds' ratios to
    export off, and their medians. Each turn's CPU is read `settle` seconds after its
    load, every gateway's alike (the exporter's last batches counted)."""
    proxies = {}
    try:
        for kind in GATEWAYS:
            proxy = bench.make_proxy(kind, "rounds")
            proxies[kind] = proxy
            proxy.start()
        turns: list[dict[str, dict[str, float]]] = []
        for n in range(rounds):
            order = GATEWAYS if n % 2 == 0 else GATEWAYS[::-1]
            turn: dict[str, dict[str, float]] = {}
            for kind in order:
                spec = {**bench.spec(row, "get_c10", proxies[kind]), "duration": seconds}
                res = bench.client(spec, proxies[kind], seconds + 60, settle=settle)
                ok = res.get("ok") or 0
                if not ok or "error" in res:
                    raise RuntimeError(f"{kind}: {res.get('error') or 'no request answered'}")
                turn[kind] = {"tree_us": res["proxy_cpu_s"] / ok * 1e6,
                              "worker_us": (res.get("proxy_cpu_s_root") or
                                            res["proxy_cpu_s"]) / ok * 1e6,
                              "requests": float(ok)}
            turns.append(turn)
    finally:
        for proxy in proxies.values():
            proxy.stop()
    out: dict[str, Any] = {"rounds": rounds, "seconds": seconds, "turns": turns}
    for kind in GATEWAYS[1:]:
        for what in ("tree", "worker"):
            ratios = [t[kind][f"{what}_us"] / t["gateway"][f"{what}_us"] for t in turns]
            out[f"{kind}_{what}_ratios"] = ratios
            out[f"{kind}_{what}_median"] = statistics.median(ratios)
    return out
