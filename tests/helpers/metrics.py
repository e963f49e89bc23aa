"""Read one metric from a running gateway's /metrics (summed over matching label sets)."""

from __future__ import annotations

import re
import urllib.request

from helpers.gateway import GatewayThread


def metric(gw: GatewayThread, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(gw.admin + "/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
