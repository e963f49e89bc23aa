#!/usr/bin/env python3
"""Refresh the model catalogue the meter bounds reservations with (``make catalogue``).

The catalogue is LiteLLM's published ``model_prices_and_context_window_backup.json`` (the
data file its wheel ships), trimmed to what the gateway reads: for each text model (modes
chat, completion, responses, embedding, realtime) its context window, maximum output and prices.
The wheel is fetched from PyPI by pip (``pip download``), at the version given
(``--version``, default: the newest), and the file is written with that version and the
date, so a reviewer sees what moved: ``gateway/services/metering/catalogue.json``.

Prices are USD per million tokens. Besides the base prices each entry keeps the dearest
input and output price the provider may bill for a token of the model (priority tiers,
long-context tiers, cache writes, audio and image tokens), which a reservation counts, and
the long-context tiers (``above``: [tokens, input, output, cached_input]) a settled call is
priced at.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "gateway/services/metering/catalogue.json"
DATA = "litellm/model_prices_and_context_window_backup.json"
MODES = {"chat", "completion", "responses", "embedding", "realtime"}
_ABOVE = re.compile(r"^input_cost_per_token_above_(\d+)k_tokens$")


def _per_million(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return round(float(value) * 1_000_000, 6)


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def trim(entry: dict[str, Any]) -> dict[str, Any] | None:
    """The catalogue's entry for one LiteLLM entry, or None if it is no text model with
    a known context window or output limit."""
    if entry.get("mode") not in MODES:
        return None
    context = _count(entry.get("max_input_tokens"))
    out_limit = _count(entry.get("max_output_tokens"))
    if entry.get("mode") == "embedding":
        out_limit = out_limit or 0
    if context is None and out_limit is None:
        return None
    row: dict[str, Any] = {"provider": str(entry.get("litellm_provider") or "")}
    if context is not None:
        row["context"] = context
    if out_limit is not None:
        row["max_output"] = out_limit
    base_in = _per_million(entry.get("input_cost_per_token"))
    base_out = _per_million(entry.get("output_cost_per_token"))
    if base_in is not None and base_out is not None:
        row["input"], row["output"] = base_in, base_out
        cached = _per_million(entry.get("cache_read_input_token_cost"))
        row["cached_input"] = cached if cached is not None else base_in
        inputs = [p for k, v in entry.items() if k.startswith(("input_cost_per", "cache_"))
                  and "token" in k and "batches" not in k and "flex" not in k
                  and (p := _per_million(v)) is not None]
        outputs = [p for k, v in entry.items() if k.startswith("output_cost_per")
                   and "token" in k and "batches" not in k and "flex" not in k
                   and (p := _per_million(v)) is not None]
        row["input_max"] = max([base_in, *inputs])
        row["output_max"] = max([base_out, *outputs])
        tiers = []
        for key in entry:
            m = _ABOVE.match(key)
            if not m:
                continue
            k = m.group(1)
            t_in = _per_million(entry[key])
            t_out = _per_million(entry.get(f"output_cost_per_token_above_{k}k_tokens"))
            t_cached = _per_million(entry.get(f"cache_read_input_token_cost_above_{k}k_tokens"))
            if t_in is None:
                continue
            tiers.append([int(k) * 1000, t_in, t_out if t_out is not None else base_out,
                          t_cached if t_cached is not None else t_in])
        if tiers:
            row["above"] = sorted(tiers)
    return row


def build(data: dict[str, Any], version: str, today: str) -> dict[str, Any]:
    models = {}
    for name, entry in sorted(data.items()):
        if name == "sample_spec" or not isinstance(entry, dict):
            continue
        row = trim(entry)
        if row is not None:
            models[name] = row
    return {"source": f"litellm {version} ({DATA})", "version": version, "updated": today,
            "units": "prices in USD per million tokens", "models": models}


def dump(doc: dict[str, Any]) -> str:
    """The catalogue as JSON, one model a line (a refresh reads as a diff of models)."""
    head = {k: v for k, v in doc.items() if k != "models"}
    lines = [json.dumps(name) + ":" + json.dumps(row, sort_keys=True, separators=(",", ":"))
             for name, row in doc["models"].items()]
    text = json.dumps(head, sort_keys=True)[:-1] + ', "models": {\n' + ",\n".join(lines)
    return text + "\n}}\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", help="LiteLLM version (default: the newest on PyPI)")
    parser.add_argument("--wheel", type=Path, help="a LiteLLM wheel already downloaded")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel
        if wheel is None:
            spec = f"litellm=={args.version}" if args.version else "litellm"
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--only-binary=:all:", "-d", tmp, spec], check=True)
            wheel = next(Path(tmp).glob("litellm-*.whl"))
        version = wheel.name.split("-")[1]
        with zipfile.ZipFile(wheel) as archive:
            data = json.loads(archive.read(DATA))
    doc = build(data, version, dt.date.today().isoformat())
    args.out.write_text(dump(doc), encoding="utf-8")
    print(f"{args.out}: {len(doc['models'])} models from litellm {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
