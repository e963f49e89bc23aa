"""The issue's targets, evaluated as ratios between rows of the same run.

Each target yields ``{name, achieved, target, status}`` with status PASS, MISS or n/a
(a row it needs was not measured, failed, or is not available yet, e.g. credential
injection). When the injection row is n/a, the intercepted targets are evaluated on
the intercept+policy row instead and say so in their name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Requests on new client connections (one request each, c10) through the gateway before
# upstream connections were pooled: this machine, same bench.
NEW_CONN_BASELINE = (669.0, 1486.0, "2026-11-26, 2 vCPU EPYC")

# (ordinary traffic with candidates: names, paths and words holding an anchor, new ids)
_AGENT = "a coding agent's chat request (OpenAI SDK head, 16 KB with code)"


def _val(rows: dict[str, Any], key: str, workload: str, field: str) -> float | None:
    res = rows.get(key, {}).get(workload)
    if not isinstance(res, dict) or "error" in res or "na" in res:
        return None
    v = res.get(field)
    return float(v) if isinstance(v, (int, float)) else None


def _target(name: str, goal: str, a: float | None, b: float | None,
            combine: Callable[[float, float], float], ok: Callable[[float], bool],
            fmt: str) -> dict[str, Any]:
    if a is None or b is None:
        return {"name": name, "target": goal, "achieved": "n/a", "value": None, "status": "n/a"}
    try:
        value = combine(a, b)
    except ZeroDivisionError:
        return {"name": name, "target": goal, "achieved": "n/a (zero)", "value": None,
                "status": "n/a"}
    return {"name": name, "target": goal, "achieved": fmt.format(value, a=a, b=b),
            "value": value, "status": "PASS" if ok(value) else "MISS"}


_CLEAN = {"post_2k": "2 KB JSON POST without a candidate",
          "post_1m": "1 MiB JSON POST without a candidate"}
# (why the instruction counts judge and the CPU rows inform: bench/dlp_instructions.py)
_BY_TIME = "informational: CPU time here moves more than the bound between runs"


def _detection(results: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """Credential detection on vs off (issue 43: within 5 % for bodies without a
    candidate): judged on the instructions a request, the CPU rows beside them."""
    ratio = lambda a, b: a / b  # noqa: E731
    counted = results.get("dlp_instructions") or {}
    for workload, what, goal in (
            ("post_2k", _CLEAN["post_2k"], "≤ 1.05x"), ("post_1m", _CLEAN["post_1m"], "≤ 1.05x"),
            ("upload", "4 MiB JSON POST, streamed, without a candidate", "≤ 1.05x"),
            ("post_agent", _AGENT + "; it holds candidates, the issue sets no bound", "—")):
        part = counted.get(workload) or {}
        out.append(_target(
            f"credential detection on vs off, {what}: the worker's instructions a request "
            "(callgrind, AVX2's pass)", goal, part.get("on"), part.get("off"), ratio,
            lambda v: v <= 1.05, "{:.3f}x ({a:,.0f} vs {b:,.0f})"))
        if goal == "—":
            out[-1]["status"] = "info" if out[-1]["status"] != "n/a" else "n/a"
    rows = results.get("rows", {})
    for workload, what, field in (
            ("post_2k", _CLEAN["post_2k"], "proxy_cpu_us_per_req"),
            ("post_1m", _CLEAN["post_1m"], "proxy_cpu_ms_per_mib"),
            ("post_agent", _AGENT, "proxy_cpu_us_per_req"),
            ("upload", "upload without a candidate", "proxy_cpu_ms_per_mib")):
        out.append(_target(
            f"credential detection on vs off, {what}: proxy CPU (same run; {_BY_TIME})",
            "—", _val(rows, "gateway_post_dlp", workload, field),
            _val(rows, "gateway_post", workload, field),
            ratio, lambda v: True, "{:.2f}x ({a:.2f} vs {b:.2f})"))
        out[-1]["status"] = "info" if out[-1]["status"] != "n/a" else "n/a"
    found = results.get("dlp_rounds") or {}
    for part, what in ((found.get("post_2k") or {}, _CLEAN["post_2k"]),
                       (found.get("post_1m") or {}, _CLEAN["post_1m"]),
                       (found.get("post_agent") or {}, _AGENT),
                       (found, "streamed upload without a candidate")):
        spread = (f"{min(part['ratios']):.2f} to {max(part['ratios']):.2f}x"
                  if part.get("ratios") else "")
        out.append(_target(
            f"credential detection on vs off, {what}: proxy CPU (median of "
            f"{found.get('rounds', 6)} alternating rounds; {_BY_TIME})", "—",
            part.get("median"), 1.0, lambda a, b: a, lambda v: True,
            "{:.2f}x (rounds " + spread + ")"))
        out[-1]["status"] = "info" if out[-1]["status"] != "n/a" else "n/a"


def evaluate(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = results.get("rows", {})
    out: list[dict[str, Any]] = []
    ratio = lambda a, b: a / b  # noqa: E731
    diff = lambda a, b: a - b  # noqa: E731

    icpt = "gateway_inject"
    icpt_name = "intercepted + injected"
    if _val(rows, icpt, "get_c10", "rps") is None and _val(
            rows, "gateway_policy", "get_c10", "rps") is not None:
        icpt, icpt_name = "gateway_policy", "intercepted + policy (injection n/a)"

    for key, what in (("gateway_otel", "a span per request"),
                      ("gateway_otel_logs", "a span and a log record per request"),
                      ("gateway_otel_sampled", "spans sampled 0.1"),
                      ("gateway_otel_apart", "a span per request, exporter on another core")):
        out.append(_target(
            f"OTLP export ({what}): CPU/request of the gateway's process tree (worker and "
            "exporter) vs off, intercepted + policy (c10)",
            "≤ 1.10x", _val(rows, key, "get_c10", "proxy_cpu_us_per_req"),
            _val(rows, "gateway_policy", "get_c10", "proxy_cpu_us_per_req"),
            ratio, lambda v: v <= 1.10, "{:.2f}x ({a:.0f} vs {b:.0f} µs)"))
        out.append(_target(
            f"OTLP export ({what}): the worker's own CPU/request vs off (its exporter "
            "process apart), intercepted + policy (c10)",
            "≤ 1.10x", _val(rows, key, "get_c10", "root_cpu_us_per_req"),
            _val(rows, "gateway_policy", "get_c10", "root_cpu_us_per_req"),
            ratio, lambda v: v <= 1.10, "{:.2f}x ({a:.0f} vs {b:.0f} µs)"))
        out.append(_target(
            f"OTLP export ({what}): requests/s vs off, intercepted + policy (c1)", "≥ 0.90x",
            _val(rows, key, "get_c1", "rps"), _val(rows, "gateway_policy", "get_c1", "rps"),
            ratio, lambda v: v >= 0.90, "{:.2f}x ({a:.0f} vs {b:.0f} req/s)"))
    found = results.get("otel_rounds") or {}
    for key, what in (("gateway_otel", "a span per request"),
                      ("gateway_otel_logs", "a span and a log record per request")):
        for part, whose in (("tree", "the gateway's process tree (worker and exporter)"),
                            ("worker", "the worker alone")):
            ratios = found.get(f"{key}_{part}_ratios") or []
            spread = f"{min(ratios):.2f} to {max(ratios):.2f}x" if ratios else ""
            out.append(_target(
                f"OTLP export ({what}): CPU/request of {whose} vs off, intercepted + policy "
                f"(c10; median of {found.get('rounds', 6)} alternating rounds)", "≤ 1.10x",
                found.get(f"{key}_{part}_median"), 1.0, lambda a, b: a,
                lambda v: v <= 1.10, "{:.2f}x (rounds " + spread + ")"))
    out.append(_target(
        f"{icpt_name}: proxy CPU/request vs mitmdump -q (c10)", "≤ 0.15x",
        _val(rows, icpt, "get_c10", "proxy_cpu_us_per_req"),
        _val(rows, "mitmdump", "get_c10", "proxy_cpu_us_per_req"),
        ratio, lambda v: v <= 0.15, "{:.2f}x ({a:.0f} vs {b:.0f} µs)"))
    out.append(_target(
        f"{icpt_name}: proxy CPU/request vs the nginx TLS reverse proxy (c10)", "≤ 6x",
        _val(rows, icpt, "get_c10", "proxy_cpu_us_per_req"),
        _val(rows, "nginx", "get_c10", "proxy_cpu_us_per_req"),
        ratio, lambda v: v <= 6, "{:.1f}x ({a:.0f} vs {b:.0f} µs)"))
    bound = " (client-bound: the load client's core was full)" if (
        rows.get(icpt, {}).get("new_c10") or {}).get("client_bound") else ""
    out.append(_target(
        f"{icpt_name}: req/s on new client connections (c10) vs before the upstream pool "
        f"({NEW_CONN_BASELINE[0]:.0f} req/s, {NEW_CONN_BASELINE[1]:.0f} µs, "
        f"{NEW_CONN_BASELINE[2]})" + bound, "≥ 2x",
        _val(rows, icpt, "new_c10", "rps"), NEW_CONN_BASELINE[0],
        ratio, lambda v: v >= 2, "{:.2f}x ({a:.0f} req/s)"))
    out.append(_target(
        f"{icpt_name}: proxy CPU per request on a new client connection vs before the "
        "upstream pool (informational: capacity the rate above cannot show when "
        "client-bound)", "—",
        _val(rows, icpt, "new_c10", "proxy_cpu_us_per_req"), NEW_CONN_BASELINE[1],
        ratio, lambda v: True, "{:.2f}x ({a:.0f} µs)"))
    out.append(_target(
        f"{icpt_name}: proxy CPU per request on a new client connection, the sandbox's TLS "
        "session resumed vs a full handshake (same run; a full handshake is what every new "
        "connection cost before resumption)", "≤ 0.7x",
        _val(rows, icpt, "resume_c10", "proxy_cpu_us_per_req"),
        _val(rows, icpt, "new_c10", "proxy_cpu_us_per_req"),
        ratio, lambda v: v <= 0.7, "{:.2f}x ({a:.0f} vs {b:.0f} µs)"))
    out.append(_target(
        "intercepted download: proxy CPU/MB vs the nginx TLS reverse proxy",
        "≤ 1.3x",
        _val(rows, "gateway_policy", "download", "proxy_cpu_ms_per_mb"),
        _val(rows, "nginx", "download", "proxy_cpu_ms_per_mb"),
        ratio, lambda v: v <= 1.3, "{:.2f}x ({a:.2f} vs {b:.2f} ms/MB)"))
    out.append(_target(
        f"{icpt_name}: req/s at c10 vs mitmdump -q", "≥ 3x",
        _val(rows, icpt, "get_c10", "rps"), _val(rows, "mitmdump", "get_c10", "rps"),
        ratio, lambda v: v >= 3, "{:.2f}x ({a:.0f} vs {b:.0f} req/s)"))
    out.append(_target(
        f"{icpt_name}: added p50 latency at c1 over direct", "≤ 0.8 ms",
        _val(rows, icpt, "get_c1", "p50_ms"), _val(rows, "direct", "get_c1", "p50_ms"),
        diff, lambda v: v <= 0.8, "{:.2f} ms ({a:.2f} vs {b:.2f})"))
    _detection(results, out)
    runs = (results.get("workers") or {}).get("workers", {})
    two = runs.get("2", {}).get("get_c10", {})
    busy = (f", machine {two['machine_busy_pct']:.0f}% busy, client {two['client_cpu_pct']:.0f}%"
            if "machine_busy_pct" in two and "client_cpu_pct" in two else "")
    out.append(_target(
        "worker scaling (2 workers vs 1, c10)", "≥ 1.6x",
        _val(runs, "2", "get_c10", "rps"), _val(runs, "1", "get_c10", "rps"),
        ratio, lambda v: v >= 1.6,
        "{:.2f}x ({a:.0f} vs {b:.0f} req/s" + busy + ")"))
    per_worker = ((runs.get("1") or {}).get("idle_rss") or {}).get("total")
    total = ((runs.get("2") or {}).get("idle_rss") or {}).get("total")
    out.append(_target(
        "idle RSS of one gateway process", "≤ 50 MiB", per_worker, 1.0,
        lambda a, b: a, lambda v: v <= 50, "{:.0f} MiB"))
    out.append(_target(
        "idle RSS of run --workers 2 (supervisor + workers: make run on 2 cores)", "≤ 150 MiB",
        total, 1.0, lambda a, b: a, lambda v: v <= 150, "{:.0f} MiB"))
    out.append(_target(
        "passthrough download: proxy CPU/MB vs squid", "≤ 1.0x",
        _val(rows, "gateway_passthrough", "download", "proxy_cpu_ms_per_mb"),
        _val(rows, "squid", "download", "proxy_cpu_ms_per_mb"),
        ratio, lambda v: v <= 1.0, "{:.2f}x ({a:.2f} vs {b:.2f} ms/MB)"))
    out.append(_target(
        "passthrough download: MB/s vs squid", "≥ 1.0x",
        _val(rows, "gateway_passthrough", "download", "mb_per_s"),
        _val(rows, "squid", "download", "mb_per_s"),
        ratio, lambda v: v >= 1.0, "{:.2f}x ({a:.0f} vs {b:.0f} MB/s)"))
    out.append(_target(
        "passthrough small requests: proxy CPU/request vs squid (c10)", "≤ 1.0x",
        _val(rows, "gateway_passthrough", "get_c10", "proxy_cpu_us_per_req"),
        _val(rows, "squid", "get_c10", "proxy_cpu_us_per_req"),
        ratio, lambda v: v <= 1.0, "{:.2f}x ({a:.0f} vs {b:.0f} µs)"))
    found = results.get("pass_rounds") or {}
    spread = (f"{min(found['ratios']):.2f} to {max(found['ratios']):.2f}x"
              if found.get("ratios") else "")
    out.append(_target(
        "passthrough small requests: proxy CPU/request vs squid (c10; median of "
        f"{found.get('rounds', 6)} alternating rounds)", "≤ 1.0x", found.get("median"), 1.0,
        lambda a, b: a, lambda v: v <= 1.0, "{:.2f}x (rounds " + spread + ")"))
    after = rows.get("gateway_policy", {}).get("idle_after_timeout")
    timeout = after.get("upstream_idle_timeout", "?") if isinstance(after, dict) else "?"
    immediate = _val(rows, "gateway_policy", "idle", "kb_per_tunnel")
    out.append(_target(
        f"idle intercepted tunnel: proxy RSS after upstream idle timeout "
        f"(upstream_idle_timeout {timeout}; immediately after the request: "
        f"{'n/a' if immediate is None else f'{immediate:.1f} KB'}, not judged)", "≤ 100 KB",
        _val(rows, "gateway_policy", "idle_after_timeout", "kb_per_tunnel"), 0.0,
        lambda a, b: a, lambda v: v <= 100, "{:.1f} KB after timeout"))
    out.append(_target(
        "idle passthrough tunnel: RSS vs squid", "≤ 1.0x",
        _val(rows, "gateway_passthrough", "idle", "kb_per_tunnel"),
        _val(rows, "squid", "idle", "kb_per_tunnel"),
        lambda a, b: a / max(b, 0.1), lambda v: v <= 1.0, "{:.2f}x ({a:.1f} vs {b:.1f} KB)"))

    pol = results.get("policy") or {}
    if pol:
        sizes = sorted(pol, key=int)
        worst = max(max(pol[n][k]["p99_us"] for k in ("tunnel", "request", "request_hot"))
                    for n in sizes)
        out.append(_target(
            f"policy decision p99, worst of {', '.join(f'{int(n):,}' for n in sizes)} rules",
            "≤ 20 µs", worst, 0.0, lambda a, b: a, lambda v: v <= 20, "{:.1f} µs"))
        lo, hi = pol[sizes[0]]["request_hot"]["p50_us"], pol[sizes[-1]]["request_hot"]["p50_us"]
        spread = pol[sizes[-1]]["request"]["p50_us"] / pol[sizes[0]]["request"]["p50_us"]
        out.append(_target(
            f"policy decision flat {int(sizes[0]):,}→{int(sizes[-1]):,} rules "
            f"(p50, same hosts; hosts spread over all rules: {spread:.1f}x)",
            "≤ 1.5x", hi, lo, ratio, lambda v: v <= 1.5, "{:.2f}x ({b:.1f}→{a:.1f} µs)"))
    else:
        out.append(_target("policy decision p99", "≤ 20 µs", None, None, ratio,
                           lambda v: True, ""))
    sec = results.get("cold_secret")
    out.append(_target(
        f"cold secret under {sec['concurrency'] if sec else 100} concurrent requests: "
        "vault calls", "= 1", float(sec["vault_calls"]) if sec else None, 0.0,
        lambda a, b: a, lambda v: v == 1, "{:.0f}"))
    met = results.get("metering") or {}
    ok = "metered_us" in met
    out.append(_target(
        f"metering: proxy CPU per streamed request, metered vs not ({met.get('chunks', 50)} "
        "events + usage; median of per-round ratios)", "≤ 1.10x",
        met.get("ratio") if ok else None, 1.0, lambda a, b: a, lambda v: v <= 1.10,
        "{:.2f}x (medians " + (f"{met['metered_us']:.0f} vs {met['plain_us']:.0f} µs)"
                               if ok else ")")))
    out.append(_target(
        "SSE first event: added delay over direct (p50)", "≤ 2 ms",
        _val(rows, "gateway_sse", "sse", "ttfe_p50_ms"), _val(rows, "direct", "sse",
                                                              "ttfe_p50_ms"),
        diff, lambda v: v <= 2, "{:.2f} ms ({a:.2f} vs {b:.2f})"))
    out.append(_target(
        "SSE later events: added delivery delay over direct (p50, informational)", "—",
        _val(rows, "gateway_sse", "sse", "event_delay_p50_ms"),
        _val(rows, "direct", "sse", "event_delay_p50_ms"),
        diff, lambda v: True, "{:.2f} ms ({a:.2f} vs {b:.2f})"))
    out[-1]["status"] = "info" if out[-1]["status"] != "n/a" else "n/a"
    return out
