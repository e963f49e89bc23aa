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
