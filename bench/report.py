"""Derived metrics, the machine description, and the text / markdown tables."""

from __future__ import annotations

import datetime
import math
import os
import platform
import shutil
import subprocess
from typing import Any

CLIENT_BOUND_PCT = 90.0  # client CPU above this: the row measures the client, not the proxy


def _version(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None and not os.path.exists(cmd[0]):
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except OSError:
        return None
    text = (out.stdout + out.stderr).strip().splitlines()
    return text[0][:120] if text else None


def machine_info() -> dict[str, Any]:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        from mitmproxy.version import VERSION as mitm_version
    except ImportError:  # pragma: no cover
        mitm_version = "missing"
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "mitmproxy": mitm_version,
        "nginx": _version([shutil.which("nginx") or "/usr/sbin/nginx", "-v"]),
        "squid": _version([shutil.which("squid") or "/usr/sbin/squid", "-v"]),
    }


def derive(workload: str, res: dict[str, Any]) -> None:
    """Add per-request / per-MB / per-tunnel figures to a workload result, in place."""
    if "error" in res or "na" in res:
        return
    cpu = res.get("proxy_cpu_s")
    if workload.startswith(("get", "new", "resume", "post")):
        if res.get("requests"):
            if cpu is not None:
                res["proxy_cpu_us_per_req"] = cpu / res["requests"] * 1e6
                if res.get("proxy_cpu_s_root") is not None:  # the gateway process alone
                    res["root_cpu_us_per_req"] = res["proxy_cpu_s_root"] / res["requests"] * 1e6
                if res.get("body_bytes"):  # (post: the bodies sent)
                    res["proxy_cpu_ms_per_mib"] = cpu * 1e3 / (
                        res["requests"] * res["body_bytes"] / (1 << 20))
                if res.get("wall_s"):  # % of one core; a supervisor + 2 workers go to 200
                    res["proxy_cpu_pct"] = 100 * cpu / res["wall_s"]
                    if "proxy_cpu_s_by_pid" in res:
                        res["proxy_cpu_pct_by_pid"] = {
                            p: 100 * c / res["wall_s"]
                            for p, c in res["proxy_cpu_s_by_pid"].items()}
            if res.get("ok", 0) != res["requests"]:
                res["warning"] = f"non-200 answers: {res.get('statuses')}"
            elif workload.startswith("resume") and res.get("resumed") != res["requests"]:
                res["warning"] = f"only {res.get('resumed')} of {res['requests']} resumed"
        res["client_bound"] = res.get("client_cpu_pct", 0) >= CLIENT_BOUND_PCT
    elif workload in ("download", "upload"):
        if cpu is not None and res.get("bytes"):
            res["proxy_cpu_ms_per_mb"] = cpu * 1e3 / (res["bytes"] / 1e6)
            res["proxy_cpu_ms_per_mib"] = cpu * 1e3 / (res["bytes"] / (1 << 20))
        if res.get("status") != 200:
            res["error"] = f"answered {res.get('status')}"
        res["client_bound"] = res.get("client_cpu_pct", 0) >= CLIENT_BOUND_PCT
    elif workload.startswith("idle"):  # idle, idle_after_timeout
        if not res.get("tunnels"):
            res["error"] = f"no tunnel opened: {res.get('first_error')}"
            return
        delta = res["proxy_rss_kb_after"] - res["proxy_rss_kb_before"]
        res["kb_per_tunnel"] = delta / res["tunnels"]


def brief(workload: str, res: dict[str, Any]) -> str:
    if "error" in res:
        return "ERROR " + res["error"][:160]
    if "na" in res:
        return "n/a (" + res["na"] + ")"
    if workload.startswith(("get", "new", "resume", "post")):
        proxy = (f"proxy {res['proxy_cpu_us_per_req']:.0f} µs CPU/req, "
                 if "proxy_cpu_us_per_req" in res else "")
        if "resumed" in res and workload.startswith("resume"):
            proxy += f"{res['resumed']}/{res['requests']} resumed, "
        return (f"{res['rps']:.0f} req/s p50 {res['p50_ms']:.2f} ms, {proxy}"
                f"client {res['client_cpu_pct']:.0f}% CPU")
    if workload in ("download", "upload"):
        proxy = (f", proxy {res['proxy_cpu_ms_per_mb']:.2f} ms CPU/MB"
                 if "proxy_cpu_ms_per_mb" in res else "")
        return f"{res['mb_per_s']:.0f} MB/s{proxy}"
    if workload == "sse":
        return (f"first event {res['ttfe_p50_ms']:.2f} ms, "
                f"event delay {res['event_delay_p50_ms']:.2f} ms")
    if workload.startswith("idle"):
        after = ""
        if "idle_wait_s" in res:
            after = (f", after {res['idle_wait_s']:.1f} s idle: upstream connections "
                     f"{res.get('upstream_conns_before_wait')}→"
                     f"{res.get('upstream_conns_after_wait')}, tunnels open "
                     f"{res.get('tunnels_open_after_wait')}")
        return (f"{res.get('kb_per_tunnel', math.nan):.1f} KB/tunnel "
                f"({res['tunnels']} tunnels{after})")
    return ""


def _get(rows: dict[str, Any], key: str, workload: str, field: str) -> Any:
    res = rows.get(key, {}).get(workload)
    if not isinstance(res, dict):
        return None
    if "na" in res:
        return "n/a"
    if "error" in res:
        return "ERR"
    return res.get(field)


def _fmt(v: Any, digits: int = 0) -> str:
    if v is None:
        return "—"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and math.isnan(v):
        return "—"
    return f"{v:,.{digits}f}"


COLUMNS = ["row", "c1 req/s", "c1 p50 ms", "c1 p99 ms", "c10 req/s", "c10 p50 ms",
           "c10 p99 ms", "proxy µs CPU/req c1 · c10", "client CPU % c1 · c10",
           "new-conn c10 req/s", "new-conn c10 p50 ms", "proxy µs CPU/new-conn req",
           "resumed new-conn c10 req/s", "proxy µs CPU/resumed new-conn req", "MB/s",
           "proxy ms CPU/MB", "SSE 1st event ms", "SSE event delay ms", "KB/idle tunnel",
           "KB/idle tunnel (after upstream idle timeout)"]


_TABLE_WORKLOADS = {"get_c1", "get_c10", "new_c10", "resume_c10", "download", "sse", "idle",
                    "idle_after_timeout"}


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = results.get("rows", {})
    out = []
    for key, entry in rows.items():
        if not set(entry) & _TABLE_WORKLOADS:  # (the POST rows: lines under the table)
            continue

        def g(w: str, f: str, d: int = 0, key: str = key) -> str:
            return _fmt(_get(rows, key, w, f), d)

        def bound(w: str, key: str = key) -> str:
            v = _get(rows, key, w, "client_cpu_pct")
            flag = "*" if _get(rows, key, w, "client_bound") is True else ""
            return _fmt(v) + flag

        out.append([
            entry.get("label", key),
            g("get_c1", "rps"), g("get_c1", "p50_ms", 2), g("get_c1", "p99_ms", 2),
            g("get_c10", "rps"), g("get_c10", "p50_ms", 2), g("get_c10", "p99_ms", 2),
            f"{g('get_c1', 'proxy_cpu_us_per_req')} · {g('get_c10', 'proxy_cpu_us_per_req')}",
            f"{bound('get_c1')} · {bound('get_c10')}",
            g("new_c10", "rps"), g("new_c10", "p50_ms", 2), g("new_c10", "proxy_cpu_us_per_req"),
            g("resume_c10", "rps"), g("resume_c10", "proxy_cpu_us_per_req"),
            g("download", "mb_per_s"), g("download", "proxy_cpu_ms_per_mb", 2),
            g("sse", "ttfe_p50_ms", 2), g("sse", "event_delay_p50_ms", 2),
            g("idle", "kb_per_tunnel", 1), g("idle_after_timeout", "kb_per_tunnel", 1),
        ])
    return out


def idle_note(results: dict[str, Any]) -> str | None:
    """What the two idle columns measured (None when no row has the after-timeout one)."""
    for entry in results.get("rows", {}).values():
        res = entry.get("idle_after_timeout")
        if isinstance(res, dict):
            timeout = res.get("upstream_idle_timeout", "?")
            waited = (f", waited {res['idle_wait_s']:.1f} s: upstream connections "
                      f"{res.get('upstream_conns_before_wait')}→"
                      f"{res.get('upstream_conns_after_wait')}, tunnels still open "
                      f"{res.get('tunnels_open_after_wait')}" if "idle_wait_s" in res else "")
            return ("KB/idle tunnel: right after each tunnel's one request (default "
                    "upstream_idle_timeout, 30 s, not reached); after upstream idle timeout: "
                    f"a gateway with network.upstream_idle_timeout: {timeout} in its "
                    f"gateway.yaml, same tunnels, measured once the upstream halves were "
                    f"closed{waited}")
    return None


def _policy_lines(results: dict[str, Any]) -> list[str]:
    pol = results.get("policy")
    lines = []
    if pol:
        lines.append("policy decision µs (p50/p99): " + "; ".join(
            f"{int(n):,} rules: tunnel {r['tunnel']['p50_us']:.1f}/{r['tunnel']['p99_us']:.1f}, "
            f"request {r['request']['p50_us']:.1f}/{r['request']['p99_us']:.1f}, "
            f"same-hosts {r['request_hot']['p50_us']:.1f}/{r['request_hot']['p99_us']:.1f}"
            for n, r in pol.items()))
    sec = results.get("cold_secret")
    if sec:
        lines.append(f"cold secret, {sec['concurrency']} concurrent gets: {sec['vault_calls']} "
                     f"vault call(s) ({sec['vault_requests_incl_challenge']} requests incl. "
                     f"the SDK's auth challenge), {sec['seconds'] * 1e3:.0f} ms")
    met = results.get("metering")
    if met and "metered_us" in met:
        lines.append(f"metering, {met['requests']:,} streamed chat completions per rule "
                     f"({met['chunks']} events + usage, c{met['conc']}, median of "
                     f"{met['rounds']} alternating rounds): metered {met['metered_us']:.0f} µs "
                     f"vs not {met['plain_us']:.0f} µs proxy CPU per request; "
                     f"{met['metered_audit_lines_with_usage']:,} audit lines with usage")
    elif met:
        lines.append(f"metering: {met.get('error', 'not measured')}")
    lines.extend(_post_lines(results))
    dlp = results.get("dlp")
    if dlp:
        lines.append(
            "credential detection (default detectors, CPU): "
            f"2 KB chat request without a candidate {dlp['small_json_clean']['us_per_request']:.0f}"
            f" µs, with a key {dlp['small_json_key']['us_per_request']:.0f} µs; 1 MiB JSON "
            f"{dlp['json_1mib_clean']['us_per_request'] / 1000:.1f} ms "
            f"({dlp['json_1mib_clean']['mb_per_s']:.0f} MB/s); {dlp['stream_upload']['mib']} MiB "
            f"streamed {dlp['stream_upload']['seconds_cpu']:.2f} s "
            f"({dlp['stream_upload']['mb_per_s']:.0f} MB/s); detect-secrets import "
            f"{dlp['library_import']['ms']} ms, {dlp['library_import']['rss_kib'] / 1024:.0f} MiB")
    return lines


def _post_lines(results: dict[str, Any]) -> list[str]:
    """The POST rows (issue 43): proxy CPU with credential detection off and on."""
    rows = results.get("rows", {})
    off, on = rows.get("gateway_post"), rows.get("gateway_post_dlp")
    if not off or not on:
        return []
    parts = []
    for workload, what, field, unit in (
            ("post_2k", "2 KB JSON", "proxy_cpu_us_per_req", "µs/req"),
            ("post_1m", "1 MiB JSON", "proxy_cpu_ms_per_mib", "ms/MiB"),
            ("post_agent", "agent's request", "proxy_cpu_us_per_req", "µs/req"),
            ("upload", "upload", "proxy_cpu_ms_per_mib", "ms/MiB")):
        a, b = _get(rows, "gateway_post", workload, field), _get(rows, "gateway_post_dlp",
                                                                 workload, field)
        if not isinstance(a, int | float) or not isinstance(b, int | float):
            parts.append(f"{what} {_fmt(a)} · {_fmt(b)}")
            continue
        size = ""
        if workload == "upload":
            size = f" {(on.get('upload') or {}).get('bytes', 0) / (1 << 20):.0f} MiB"
        parts.append(f"{what}{size} {a:.{0 if unit == 'µs/req' else 2}f} · "
                     f"{b:.{0 if unit == 'µs/req' else 2}f} {unit} ({b / a:.2f}x)")
    return ["POST without a credential, proxy CPU, credential detection off · on: "
            + "; ".join(parts)]


WORKER_COLUMNS = ["workers", "conc", "req/s", "p50 ms", "p99 ms", "proxy µs CPU/req",
                  "proxy CPU % (per process)", "client CPU %", "machine busy %"]


def worker_rows(results: dict[str, Any]) -> list[list[str]]:
    """The workers section: one line per (worker count, concurrency)."""
    runs = (results.get("workers") or {}).get("workers", {})
    out = []
    for n, entry in runs.items():
        for w, res in entry.items():
            if not w.startswith("get_c"):  # (idle_rss: a line under the table)
                continue
            conc = w.removeprefix("get_c")
            if "error" in res:
                out.append([n, conc, "ERR"] + ["—"] * (len(WORKER_COLUMNS) - 3))
                continue
            split = res.get("proxy_cpu_pct_by_pid")
            per = (" (" + " + ".join(f"{v:.0f}" for v in split.values()) + ")") if split else ""
            flag = "*" if res.get("client_bound") else ""
            out.append([
                n, conc, _fmt(res.get("rps")), _fmt(res.get("p50_ms"), 2),
                _fmt(res.get("p99_ms"), 2), _fmt(res.get("proxy_cpu_us_per_req")),
                _fmt(res.get("proxy_cpu_pct")) + per,
                _fmt(res.get("client_cpu_pct")) + flag, _fmt(res.get("machine_busy_pct")),
            ])
    return out


def _idle_text(found: dict[str, Any]) -> str:
    workers = " + ".join(f"{w:.0f}" for w in found.get("workers", []))
    return f"{found['total']:.0f}" + (f" ({found['process']:.0f} + {workers})" if workers
                                       else "")


def _worker_lines(results: dict[str, Any]) -> tuple[str, list[str]]:
    """The workers section's title and its lines under the table."""
    sec = results.get("workers") or {}
    title = (f"worker scaling: `run --workers N`, {sec.get('label', '?')}, "
             f"{sec.get('duration_s', 0):g} s per run, unpinned on cores "
             f"{','.join(str(c) for c in sec.get('cores', []))}")
    scaling = sec.get("scaling", {})
    lines = ["scaling, req/s 2 workers ÷ 1 worker: " + (" · ".join(
        f"c{w.removeprefix('get_c')} {v:.2f}x" for w, v in scaling.items()) or "n/a"),
        "proxy CPU % is of one core, summed over the supervisor and every worker "
        "(per process in brackets, the supervisor first); machine busy % is of all cores",
        str(sec.get("note", ""))]
    idle = [f"{n} worker{'s' if n != '1' else ''}: {_idle_text(entry['idle_rss'])}"
            for n, entry in sec.get("workers", {}).items() if "idle_rss" in entry]
    if idle:
        lines.append("idle RSS right after start (MiB): " + " · ".join(idle))
    return title, lines


def _meta_line(results: dict[str, Any]) -> str:
    m = results.get("meta", {})
    cores = m.get("cores", {})
    return (f"{m.get('date')} · {m.get('nproc')} vCPU {m.get('cpu_model')} · kernel "
            f"{m.get('kernel')} · Python {m.get('python')} · mitmproxy {m.get('mitmproxy')} · "
            f"{m.get('squid') or 'squid missing'} · upstream {m.get('upstream', '?')} "
            f"({m.get('nginx') or 'no nginx'}) · proxy core {cores.get('proxy')}, client+upstream "
            f"core {cores.get('client_and_upstream')}" + (" · QUICK" if m.get("quick") else ""))


def _target_lines(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    return [(t["status"], t["name"], t["achieved"], t["target"])
            for t in results.get("targets", [])]


def text_table(results: dict[str, Any]) -> str:
    rows = table_rows(results)
    widths = [max(len(COLUMNS[i]), *(len(r[i]) for r in rows)) if rows else len(COLUMNS[i])
              for i in range(len(COLUMNS))]
    lines = [_meta_line(results), ""]
    if rows:
        lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                               for i, c in enumerate(COLUMNS)))
        for r in rows:
            lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                                   for i, c in enumerate(r)))
        lines.append("(* = client-bound: the load client used ≥90% of its core)")
        note = idle_note(results)
        if note:
            lines.append(note)
        lines.append("")
    wrows = worker_rows(results)
    if wrows:
        title, notes = _worker_lines(results)
        ww = [max(len(WORKER_COLUMNS[i]), *(len(r[i]) for r in wrows))
              for i in range(len(WORKER_COLUMNS))]
        lines.append(title.replace("`", ""))
        lines.append("  ".join(c.rjust(ww[i]) for i, c in enumerate(WORKER_COLUMNS)))
        lines.extend("  ".join(c.rjust(ww[i]) for i, c in enumerate(r)) for r in wrows)
        lines.extend(notes)
        lines.append("")
    lines.extend(_policy_lines(results))
    lines.append("")
    lines.append("targets (ratios from this run):")
    for status, name, achieved, target in _target_lines(results):
        lines.append(f"  {status:<4}  {name}: {achieved}  (target {target})")
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    rows = table_rows(results)
    lines = [f"_{_meta_line(results)}_", ""]
    if rows:
        lines.extend(["| " + " | ".join(COLUMNS) + " |",
                      "|" + "|".join("---" if i == 0 else "---:"
                                     for i in range(len(COLUMNS))) + "|"])
        lines.extend("| " + " | ".join(r) + " |" for r in rows)
        lines.append("")
        lines.append("`*` client-bound (load client ≥90% of its core). "
                     "`—` not measured for that row.")
        lines.append("")
        note = idle_note(results)
        if note:
            lines.extend([note + ".", ""])
    wrows = worker_rows(results)
    if wrows:
        title, notes = _worker_lines(results)
        lines.extend([f"**{title}**", "",
                      "| " + " | ".join(WORKER_COLUMNS) + " |",
                      "|" + "|".join("---:" for _ in WORKER_COLUMNS) + "|"])
        lines.extend("| " + " | ".join(r) + " |" for r in wrows)
        lines.append("")
        lines.extend([notes[0], "", f"{notes[1]}. {notes[2]}"])
        lines.append("")
    lines.extend(f"- {line}" for line in _policy_lines(results))
    lines.append("")
    lines.append("| target | achieved | goal | |")
    lines.append("|---|---|---|---|")
    for status, name, achieved, target in _target_lines(results):
        lines.append(f"| {name} | {achieved} | {target} | {status} |")
    return "\n".join(lines) + "\n"
