"""``python -m bench.policy_replay [--lines 1000000]``: time ``policy diff --replay``.

Generates an audit file shaped like the gateway's own lines (every field, ~490 bytes a
line; CONNECT tunnels, intercepted requests with varied paths, denials, lines without a
policy), a narrowed copy of ``policies/`` (``narrow``: ``api.github.com`` loses HEAD,
``registry.npmjs.org`` keeps only port 443), then runs the real CLI, ``sandbox-gateway
policy diff --base policies <narrowed> --replay <file> --format json``, as a subprocess
and reports wall time, the CLI's own replay time, lines/s and peak memory.

Not a test (it writes ~450 MB at the default size);
``tests/services/policy/test_policy_diff.py`` runs a small size with a generous bound.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ROOT / "policies"

# (policy, method, scheme, host, port, path template); {n} varies the path.
_SHAPES: list[tuple[str, str | None, str | None, str, int, str | None]] = [
    ("coding-agent", "CONNECT", None, "pypi.org", 443, None),
    ("coding-agent", "CONNECT", None, "files.pythonhosted.org", 443, None),
    ("coding-agent", "CONNECT", None, "github.com", 443, None),
    ("base", "CONNECT", None, "registry.npmjs.org", 443, None),
    ("coding-agent", "GET", "https", "api.github.com", 443, "/repos/org/repo{n}/pulls"),
    ("coding-agent", "HEAD", "https", "api.github.com", 443, "/repos/org/repo{n}"),
    ("coding-agent", "POST", "https", "api.github.com", 443, "/repos/org/repo{n}/issues"),
    ("coding-agent", "POST", "https", "api.openai.com", 443, "/v1/chat/completions"),
    ("coding-agent", "POST", "https", "api.openai.com", 443, "/v1/responses"),
    ("coding-agent", "GET", "https", "api.openai.com", 443, "/v1/models/m{n}"),
    ("coding-agent", "CONNECT", None, "evil{n}.example", 443, None),
    ("base", "GET", "https", "api.github.com", 443, "/user"),
]
_WEIGHTS = [30, 10, 8, 8, 15, 5, 3, 12, 4, 2, 2, 1]


def narrow(src: Path, dst: Path) -> None:
    """A plausible PR: GitHub API loses HEAD; npm tunnels only on 443 (unchanged traffic)."""
    shutil.copytree(src, dst)
    agent = dst / "coding-agent.yaml"
    agent.write_text(agent.read_text().replace("methods: [GET, HEAD]", "methods: [GET]"))
    base = dst / "base.yaml"
    base.write_text(base.read_text().replace(
        "  - host: registry.npmjs.org\n", "  - host: registry.npmjs.org\n    ports: [443]\n"))


def write_audit(out: IO[str], lines: int, distinct_paths: int, seed: int = 1) -> None:
    """``lines`` audit lines; path variety bounded by ``distinct_paths``."""
    rng = random.Random(seed)
    shapes = rng.choices(_SHAPES, _WEIGHTS, k=lines)
    for i, (policy, method, scheme, host, port, path) in enumerate(shapes):
        n = rng.randrange(distinct_paths)
        record: dict[str, Any] = {
            "sandbox": f"sbx-{i % 500}", "policy": policy if i % 997 else None,
            "jti": f"{rng.getrandbits(128):032x}",
            "client": f"10.0.{i % 250}.7:{40000 + i % 20000}",
            "method": method, "scheme": scheme, "host": host.format(n=n % 50), "port": port,
            "path": path.format(n=n) if path else None, "decision": "allow",
            "reason": f"allowed by rule policies/base.yaml:9 (host: {host})",
            "rule": "policies/base.yaml:9", "status": 200, "error": None,
            "bytes_in": rng.randrange(100_000), "bytes_out": rng.randrange(5_000),
            "duration_ms": round(rng.random() * 300, 3),
            "path_taken": "passthrough" if method == "CONNECT" else "intercept",
            "credential": "openai" if host == "api.openai.com" else None, "worker": i % 2,
            "time": "2026-11-22T02:47:15.665Z",
        }
        out.write(json.dumps(record, separators=(",", ":")) + "\n")


def run(lines: int, distinct_paths: int, keep: Path | None = None) -> dict[str, Any]:
    """Generate, replay through the CLI, and return the measurements."""
    with tempfile.TemporaryDirectory(prefix="policy-replay-") as tmp:
        work = Path(tmp)
        audit = keep or work / "audit.jsonl"
        started = time.perf_counter()
        with audit.open("w", encoding="utf-8") as handle:
            write_audit(handle, lines, distinct_paths)
        generated = time.perf_counter() - started
        narrowed = work / "narrowed"
        narrow(POLICIES, narrowed)
        cli = Path(sys.executable).with_name("sandbox-gateway")
        argv = [str(cli), "policy", "diff", "--base", str(POLICIES), str(narrowed),
                "--replay", str(audit), "--format", "json"]
        started = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"policy diff failed ({done.returncode}): {done.stderr}")
        result = json.loads(done.stdout)["replay"]
        peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        return {
            "lines": result["lines"], "distinct": result["distinct"],
            "file_mb": round(audit.stat().st_size / 1e6, 1),
            "generate_s": round(generated, 2), "wall_s": round(wall, 2),
            "replay_s": result["seconds"], "lines_per_s": round(result["lines"] / wall),
            "peak_rss_mb": round(peak_kb / 1024, 1),
            "newly_denied": sum(g["requests"] for g in result["newly_denied"]),
            "skipped": result["skipped"],
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.policy_replay", description=__doc__)
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--distinct-paths", type=int, default=20_000)
    parser.add_argument("--keep", type=Path, help="write the audit file here and keep it")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.lines, args.distinct_paths, args.keep), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
