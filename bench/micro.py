"""In-process measurements: policy decision time vs rule count, and a cold secret under load.

Policy: `gateway.services.policy.compile_policy` over N generated rules (exact hosts, ``*.``
and ``**.`` wildcards, some with methods/paths), then ``decide`` timed one call at a
time with ``perf_counter_ns`` for tunnel-level (CONNECT) and request-level decisions
on hosts spread over the whole rule set, plus misses.

Cold secret: `SecretCache` in front of the real `AzureKeyVaultStore` (Azure SDK)
talking TLS to the local fake Key Vault of the test suite (``tests/fakes/keyvault.py``);
100 concurrent ``get`` of a name never fetched; counts the authorized secret GETs the
vault saw (the SDK's unauthenticated challenge round trip is reported apart).
"""

from __future__ import annotations

import asyncio
import gc
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway.core.policy import Request, Rule, compile_policy, decide

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))


def _rules(n: int) -> list[Rule]:
    rules: list[Rule] = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            rules.append(Rule(host=f"h{i}.svc{i % 97}.example.com"))
        elif kind == 1:
            rules.append(Rule(host=f"*.w{i}.example.org"))
        elif kind == 2:
            rules.append(Rule(host=f"**.d{i}.example.net", ports=[443, 8443]))
        else:
            rules.append(Rule(host=f"api{i}.example.io", methods=["GET", "POST"],
                              paths=["/v1/**", f"/items/{i}/*"]))
    return rules


def _requests(n: int, count: int, rng: random.Random) -> list[Request]:
    out: list[Request] = []
    for _ in range(count):
        i = rng.randrange(n)
        kind = i % 4
        if rng.random() < 0.1:
            out.append(Request("GET", "https", f"miss{i}.nowhere.example", 443, "/"))
        elif kind == 0:
            out.append(Request("GET", "https", f"h{i}.svc{i % 97}.example.com", 443, "/x"))
        elif kind == 1:
            out.append(Request("GET", "https", f"a.w{i}.example.org", 443, "/"))
        elif kind == 2:
            out.append(Request("POST", "https", f"x.y.d{i}.example.net", 8443, "/p"))
        else:
            out.append(Request("GET", "https", f"api{i}.example.io", 443, "/v1/a/b?q=1"))
    return out


def _pct_us(values: list[int], q: float) -> float:
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k] / 1000


def policy_decisions(sizes: list[int], samples: int, seed: int = 7) -> dict[str, Any]:
    """p50/p99 decision time (µs) per rule count, tunnel and request level."""
    out: dict[str, Any] = {}
    clock = time.perf_counter_ns
    for n in sizes:
        t0 = time.perf_counter()
        policy = compile_policy("bench", _rules(n))
        compile_s = time.perf_counter() - t0
        rng = random.Random(seed)
        reqs = _requests(n, samples, rng)
        tunnels = [Request(None, "https", r.host, r.port, None) for r in reqs]
        hot = _requests(min(n, 10), samples, random.Random(seed))
        gc.collect()
        row: dict[str, Any] = {"rules": n, "compile_s": compile_s, "samples": samples}
        for label, batch in (("tunnel", tunnels), ("request", reqs), ("request_hot", hot)):
            for r in batch[:200]:  # warm caches
                decide(policy, r)
            times: list[int] = []
            allowed = 0
            for r in batch:
                s = clock()
                d = decide(policy, r)
                times.append(clock() - s)
                allowed += d.allowed
            times.sort()
            row[label] = {"p50_us": _pct_us(times, 50), "p99_us": _pct_us(times, 99),
                          "allowed_fraction": allowed / len(batch)}
        out[str(n)] = row
        del policy
    return out


def cold_secret(concurrency: int = 100, latency: float = 0.05) -> dict[str, Any]:
    """Vault calls made for ``concurrency`` simultaneous gets of a never-fetched secret."""
    from fakes.keyvault import FakeKeyVault, StaticCredential, sdk_transport

    from gateway.services.secrets import AzureKeyVaultStore, SecretCache

    name = "bench-cold-secret"
    with tempfile.TemporaryDirectory(prefix="bench-kv-") as tmp:
        kv = FakeKeyVault(Path(tmp))
        with kv:
            kv.set_secret(name, "cold-value")
            kv.latency[name] = latency

            async def main() -> dict[str, Any]:
                async with sdk_transport(kv) as transport:
                    store = AzureKeyVaultStore(
                        kv.vault_url(), transport=transport,
                        credential_obj=StaticCredential(kv.issue_static_token()))
                    cache = SecretCache(store)
                    try:
                        t0 = time.perf_counter()
                        values = await asyncio.gather(
                            *(cache.get(name) for _ in range(concurrency)))
                        elapsed = time.perf_counter() - t0
                    finally:
                        await cache.close()
                        await store.close()
                return {"concurrency": concurrency, "vault_latency_s": latency,
                        "all_values_ok": all(v.reveal() == "cold-value" for v in values),
                        "seconds": elapsed}

            result = asyncio.run(main())
            result["vault_calls"] = kv.count(name, authorized=True)
            result["vault_requests_incl_challenge"] = kv.count(name)
    return result


def dlp_scan(stream_mib: int = 100, seed: int = 43) -> dict[str, Any]:
    """Outbound credential detection (gateway/core/dlp), CPU time per scan with the
    default detectors: a ~2 KB chat request without candidates (head and body, the
    intercepted path's case), the same with a key, a 1 MiB JSON body, and a streamed
    upload of `stream_mib` MiB fed in 64 KiB chunks (random base64-free text), each with
    its gate pass (`ChunkPass`, which the proxy shares with the leak guard). Also the
    import cost of the detector library (detect-secrets, measured in a fresh
    interpreter)."""
    import json
    import subprocess

    from gateway.core.dlp import DEFAULT, Scanner, StreamScanner
    from gateway.core.dlp.fastscan import ChunkPass
    from gateway.services.dlp.library import build

    scanner = Scanner(build(DEFAULT), b"bench-salt", limit=64 << 20)
    rng = random.Random(seed)
    words = ("the", "request", "model", "parse", "file", "rows", "return", "value", "quoted",
             "field", "def", "import", "json", "error", "stream", "token", "count", "user")

    def prose(n: int) -> str:
        out: list[str] = []
        size = 0
        while size < n:
            word = rng.choice(words)
            out.append(word)
            size += len(word) + 1
        return " ".join(out)[:n]

    def chat(text: str) -> bytes:
        return json.dumps({"model": "gpt-4o", "stream": True, "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": text}]}).encode()

    head = [("Content-Type", "application/json"), ("User-Agent", "OpenAI/Python 1.40.0"),
            ("Accept", "application/json"), ("X-Stainless-Lang", "python")]

    def timed(call: Any, reps: int) -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.process_time()
            for _ in range(reps):
                call()
            best = min(best, (time.process_time() - t0) / reps)
        return best

    small = chat(prose(1900))
    key = "ghp_" + "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") for _ in range(36))
    small_key = chat(prose(1900) + " " + key)
    big = chat(prose(1 << 20))
    out: dict[str, Any] = {}
    for name, body, reps in (("small_json_clean", small, 2000), ("small_json_key", small_key, 500),
                             ("json_1mib_clean", big, 3)):
        each = timed(lambda b=body: scanner.scan_request("POST", "/v1/chat/completions",
                                                         head, b), reps)
        out[name] = {"bytes": len(body), "us_per_request": round(each * 1e6, 1),
                     "mb_per_s": round(len(body) / each / 1e6, 1)}
    assert not scanner.scan_request("POST", "/", head, small).findings
    assert scanner.scan_request("POST", "/", head, small_key).findings

    chunk = prose(64 << 10).encode()
    t0 = time.process_time()
    stream = StreamScanner(scanner)
    chunks = ChunkPass(scanner.prefilter.gate)  # (the proxy's one pass a chunk: its answer
    for _ in range(stream_mib * 16):            # serves the leak guard too)
        stream.feed(chunk, chunks.flags(chunk))
    stream.end()
    spent = time.process_time() - t0
    out["stream_upload"] = {"mib": stream_mib, "seconds_cpu": round(spent, 2),
                            "mb_per_s": round(stream_mib * (1 << 20) / spent / 1e6, 1)}
    # (VmRSS, not ru_maxrss: a child's high-water mark starts at its parent's at fork)
    code = ("import time, re\n"
            "def rss(): return int(re.search(r'VmRSS:\\s+(\\d+)', "
            "open('/proc/self/status').read()).group(1))\n"
            "r0 = rss(); t = time.perf_counter()\n"
            "import gateway.services.dlp.library as l; l.build()\n"
            "print(time.perf_counter() - t, rss() - r0)")
    seconds, kib = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  check=True, cwd=ROOT).stdout.split()
    out["library_import"] = {"ms": round(float(seconds) * 1000), "rss_kib": int(kib)}
    return out
