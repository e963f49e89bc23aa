"""The benchmark cannot rot: ``python -m bench --quick`` runs end to end (tiny sizes).

It drives the real tools (nginx, squid, mitmdump, the gateway) on 127.0.0.1, so a
missing tool fails here loudly (``make tools`` / ``scripts/test-tools.sh`` installs
them). The full benchmark is never part of the test command: ``make bench``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import ROWS, SECTIONS

ROOT = Path(__file__).resolve().parent.parent
EXPECTED_ROWS = {"direct", "gateway_passthrough", "gateway_policy", "gateway_otel",
                 "gateway_otel_logs", "gateway_otel_sampled", "gateway_otel_apart",
                 "gateway_inject",
                 "gateway_sse", "gateway_post", "gateway_post_dlp", "nginx", "mitmdump",
                 "squid"}
WORKLOAD_FIELDS = {
    "get_c1": ("rps", "p50_ms", "p99_ms", "client_cpu_pct"),
    "get_c10": ("rps", "p50_ms", "p99_ms", "client_cpu_pct"),
    "new_c10": ("rps", "p50_ms", "p99_ms", "client_cpu_pct"),
    "resume_c10": ("rps", "p50_ms", "p99_ms", "client_cpu_pct", "resumed"),
    "download": ("mb_per_s",),
    "sse": ("ttfe_p50_ms", "event_delay_p50_ms"),
    "idle": ("kb_per_tunnel",),
    "idle_after_timeout": ("kb_per_tunnel", "idle_wait_s"),
    "post_2k": ("rps", "p50_ms", "proxy_cpu_us_per_req", "proxy_cpu_ms_per_mib"),
    "post_1m": ("rps", "p50_ms", "proxy_cpu_us_per_req", "proxy_cpu_ms_per_mib"),
    "post_agent": ("rps", "p50_ms", "proxy_cpu_us_per_req", "proxy_cpu_ms_per_mib"),
    "upload": ("mb_per_s", "proxy_cpu_ms_per_mib"),
}
EXPECTED_SECTIONS = {"workers", "otel_rounds", "pass_rounds", "dlp_rounds", "dlp_instructions",
                     "policy", "secret", "metering", "dlp"}
WORKER_FIELDS = ("rps", "p50_ms", "p99_ms", "client_cpu_pct", "proxy_cpu_us_per_req",
                 "proxy_cpu_pct", "machine_busy_pct")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_benchmark_produces_every_row_and_workload(tmp_path: Path) -> None:
    out = tmp_path / "quick.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())

    meta = results["meta"]
    assert meta["quick"] is True
    assert meta["upstream"] == "nginx", "nginx is missing: run scripts/test-tools.sh"
    assert meta["squid"], "squid is missing: run scripts/test-tools.sh"
    for key in ("date", "nproc", "cpu_model", "kernel"):
        assert meta[key]

    assert {r.key for r in ROWS} == EXPECTED_ROWS
    assert set(results["rows"]) == EXPECTED_ROWS
    for row in ROWS:
        entry = results["rows"][row.key]
        assert set(row.workloads) <= set(entry), row.key
        for workload in row.workloads:
            res = entry[workload]
            assert "error" not in res, f"{row.key}/{workload}: {res['error']}"
            assert "na" not in res, f"{row.key}/{workload}: {res['na']}"
            for field in WORKLOAD_FIELDS[workload]:
                assert isinstance(res[field], int | float), f"{row.key}/{workload}/{field}"
            if workload.startswith(("get", "new", "resume", "post")):
                assert res["ok"] == res["requests"] > 0, f"{row.key}/{workload}: {res}"
            if workload == "upload":
                assert res["status"] == 200 and res["bytes"] > 0, f"{row.key}: {res}"
            if workload.startswith("resume"):  # every connection resumed its TLS session
                assert res["resumed"] == res["requests"], f"{row.key}/{workload}: {res}"
            if row.proxy is not None and workload.startswith(("get", "new", "resume")):
                assert "proxy_cpu_us_per_req" in res

    # the OTLP rows' gateways exported to the bench's receiver: spans, and log records
    # (one per request of the audit.otlp row, and its warm-ups)
    received = meta["otlp_received"]
    otel_logs = results["rows"]["gateway_otel_logs"]
    assert received["logs"] >= otel_logs["get_c1"]["requests"] + otel_logs["get_c10"]["requests"]
    assert received["spans"] > received["logs"]
    # the export off and on in alternating rounds: every turn measured, medians judged
    rounds = results["otel_rounds"]
    assert "error" not in rounds, rounds
    assert len(rounds["turns"]) == rounds["rounds"] == 2
    for turn in rounds["turns"]:
        assert set(turn) == {"gateway", "gateway_otel", "gateway_otel_logs"}
        assert all(t["tree_us"] >= t["worker_us"] > 0 for t in turn.values())
    for key in ("gateway_otel", "gateway_otel_logs"):
        assert rounds[f"{key}_tree_median"] > 0
        assert any(t["name"].startswith("OTLP export") and "alternating rounds" in t["name"]
                   and t["value"] == rounds[f"{key}_tree_median"] for t in results["targets"])

    # passthrough and squid in alternating rounds: every turn measured, the median judged
    passing = results["pass_rounds"]
    assert "error" not in passing, passing
    assert len(passing["turns"]) == len(passing["ratios"]) == passing["rounds"] == 2
    assert all(set(turn) == {"gateway", "squid"} and min(turn.values()) > 0
               for turn in passing["turns"])
    assert any(t["name"].startswith("passthrough small requests") and "alternating" in
               t["name"] and t["value"] == passing["median"] for t in results["targets"])

    # the POST rows' workloads with detection off and on in alternating rounds: every
    # turn measured, each median judged
    detecting = results["dlp_rounds"]
    assert "error" not in detecting, detecting
    for part, what in ((detecting["post_2k"], "2 KB JSON POST"),
                       (detecting["post_1m"], "1 MiB JSON POST"),
                       (detecting["post_agent"], "a coding agent's chat request"),
                       (detecting, "streamed upload")):
        assert len(part["turns"]) == len(part["ratios"]) == detecting["rounds"] == 2
        assert all(set(turn) == {"off", "on"} and min(turn.values()) > 0
                   for turn in part["turns"])
        assert any(t["name"].startswith(f"credential detection on vs off, {what}") and
                   "alternating" in t["name"] and t["value"] == part["median"]
                   for t in results["targets"])

    # the intercepted row's idle tunnels, again after a 2 s upstream idle timeout: every
    # upstream connection closed, every tunnel still open
    assert "idle_after_timeout" in next(r for r in ROWS if r.key == "gateway_policy").workloads
    after = results["rows"]["gateway_policy"]["idle_after_timeout"]
    assert after["upstream_idle_timeout"] == "2s"
    assert 0 < after["upstream_conns_before_wait"] <= after["tunnels"], after
    assert after["upstream_conns_after_wait"] == 0, after
    assert after["tunnels_open_after_wait"] == after["tunnels"], after
    assert after["idle_wait_s"] >= 4.0
    idle_target = next(t for t in results["targets"]
                       if t["name"].startswith("idle intercepted tunnel"))
    assert "after upstream idle timeout" in idle_target["name"]
    assert "immediately after the request" in idle_target["name"]
    assert idle_target["value"] == after["kb_per_tunnel"]
    assert "KB/idle tunnel (after upstream idle timeout)" in proc.stdout
    assert "upstream_idle_timeout: 2s" in proc.stdout

    # workers: `run --workers 1` and `--workers 2`, unpinned, c10 (quick: c10 only)
    assert set(SECTIONS) == EXPECTED_SECTIONS
    workers = results["workers"]
    assert set(workers["workers"]) == {"1", "2"}
    for n, entry in workers["workers"].items():
        res = entry["get_c10"]
        assert "error" not in res, f"workers={n}: {res['error']}"
        for field in WORKER_FIELDS:
            assert isinstance(res[field], int | float), f"workers={n}/{field}"
        assert res["ok"] == res["requests"] > 0, f"workers={n}: {res}"
    # CPU is summed over the supervisor and both workers
    assert workers["workers"]["1"]["get_c10"]["proxy_processes"] == 1
    assert workers["workers"]["2"]["get_c10"]["proxy_processes"] == 3
    assert len(workers["workers"]["2"]["get_c10"]["proxy_cpu_s_by_pid"]) == 3
    assert workers["scaling"]["get_c10"] > 0
    assert "0.8 x N" in workers["note"]
    names = {t["name"] for t in results["targets"]}
    assert "worker scaling (2 workers vs 1, c10)" in names
    assert "worker scaling" in proc.stdout

    assert set(results["policy"]) == {"10", "100", "1000"}
    for entry in results["policy"].values():
        for level in ("tunnel", "request", "request_hot"):
            assert entry[level]["p99_us"] > 0
    assert results["cold_secret"]["vault_calls"] == 1
    # the POST rows: detection off and on in one gateway, a line under the table, targets
    assert "POST without a credential, proxy CPU, credential detection off · on" in proc.stdout
    for what in ("2 KB JSON POST without", "1 MiB JSON POST without",
                 "a coding agent's chat request", "upload without"):
        target = next(t for t in results["targets"] if t["name"].startswith(
            f"credential detection on vs off, {what}") and "same run" in t["name"])
        assert target["status"] == "info", target  # (judged on instructions: below)
    # the judged reading, instructions under callgrind, is not counted by --quick
    assert "dlp_instructions" not in results
    counted = [t for t in results["targets"] if "instructions a request" in t["name"]]
    assert [t["target"] for t in counted] == ["≤ 1.05x"] * 3 + ["—"], counted
    assert {t["status"] for t in counted} == {"n/a"}, counted
    dlp = results["dlp"]
    assert {"small_json_clean", "small_json_key", "json_1mib_clean", "stream_upload",
            "library_import"} <= set(dlp)
    assert dlp["small_json_clean"]["us_per_request"] > 0

    # metering: the same streamed call metered and not; every metered call left its usage
    metered = results["metering"]
    assert "error" not in metered, metered.get("error")
    assert metered["requests"] > 0 and metered["ratio"] > 0
    assert metered["events_per_request"] > metered["chunks"]
    assert metered["metered_audit_lines_with_usage"] >= metered["requests"]
    assert any(t["name"].startswith("metering") for t in results["targets"]), names
    statuses = {t["status"] for t in results["targets"] if t not in counted}
    assert statuses <= {"PASS", "MISS", "info"}, results["targets"]

    assert "targets (ratios from this run)" in proc.stdout
    assert out.with_suffix(".md").read_text().startswith("_")
