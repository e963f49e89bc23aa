"""The core's telemetry port on Prometheus (observability/metrics.py `Prometheus`): every
event the code counts has a metric, and counting reaches it."""

from __future__ import annotations

import ast
from pathlib import Path

from gateway.core.ports import SILENT
from gateway.observability import metrics

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
KINDS = {"count": metrics.Prometheus.COUNTS, "gauge": metrics.Prometheus.GAUGES,
         "observe": metrics.Prometheus.HISTOGRAMS}


def _uses() -> set[tuple[str, str, str]]:
    """(method, event, where) of every `<...>telemetry.<method>("event", ...)` call."""
    found = set()
    for path in GATEWAY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in KINDS and "telemetry" in ast.unparse(node.func.value)
                    and node.args and isinstance(node.args[0], ast.Constant)):
                found.add((node.func.attr, str(node.args[0].value), path.name))
    return found


def test_every_event_counted_has_a_metric() -> None:
    uses = _uses()
    assert len(uses) >= 15  # (the walk finds the call sites)
    missing = sorted(u for u in uses if u[1] not in KINDS[u[0]])
    assert missing == []


def test_counting_reaches_the_metric() -> None:
    before = metrics.REGISTRY.get_sample_value(
        "sandbox_gateway_exfiltration_blocked_total", {"kind": "body"}) or 0.0
    metrics.TELEMETRY.count("exfiltration_blocked", "body")
    SILENT.count("exfiltration_blocked", "body")  # (counts nothing)
    after = metrics.REGISTRY.get_sample_value(
        "sandbox_gateway_exfiltration_blocked_total", {"kind": "body"})
    assert after == before + 1
