"""`make demo`: the gateway, a stand-in OpenAI and an agent configured only by
`sandbox-gateway env`, all on 127.0.0.1, in a few seconds, no Docker.

Shows the key swap (the provider sees the real key, the agent only ever held its
token) and a refusal (a host the policy does not allow), then exits 0 only if both
happened exactly so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fake_provider import FakeOpenAI  # noqa: E402

REAL_KEY = "sk-demo-REAL-provider-key-7f3a9c"
POLICY = """\
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai        # the gateway swaps the sandbox token for the key here
credentials:
  openai: {preset: openai, secret: openai-api-key}
"""


def cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True,
                         text=True, timeout=60, check=False)
    if out.returncode != 0:
        sys.exit(f"sandbox-gateway {args[0]} failed:\n{out.stderr}")
    return out.stdout


def start_gateway(config: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`sandbox-gateway run` on free ports; returns the process and its proxy URL."""
    err = log.with_suffix(".err")
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "run", "--config", str(config),
                             "--workers", "1"], stdout=log.open("wb"), stderr=err.open("wb"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"proxy\s+(http://\S+)", err.read_text(errors="replace"))
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    sys.exit(f"the gateway did not start:\n{err.read_text(errors='replace')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true",
                        help="keep the working directory (config, CA, audit lines)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sandbox-gateway-demo-"))
    try:
        return run(work)
    finally:
        if args.keep:
            print(f"(files in {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)


def run(work: Path) -> int:
    provider = FakeOpenAI(work, REAL_KEY)
    (work / "policies").mkdir()
    (work / "policies" / "agent.yaml").write_text(POLICY)
    secrets = work / "secrets.yaml"
    secrets.write_text(f"openai-api-key: {REAL_KEY}\n")
    secrets.chmod(0o600)
    config = work / "gateway.yaml"
    config.write_text(json.dumps({
        "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0"},
        "policies": "./policies", "certs": "./certs",
        "secrets": {"store": "file", "path": "./secrets.yaml"},
        "network": {"upstream_ca": str(provider.ca_path),
                    "resolve": {"api.openai.com": f"127.0.0.1:{provider.port}"}}}))
    gateway, proxy = start_gateway(config, work / "audit.jsonl")
    try:
        print(f"1. gateway listening at {proxy}; api.openai.com is a local stand-in "
              f"(127.0.0.1:{provider.port}) holding out for the real key")
        token = cli("token", "mint", "--config", str(config), "--sandbox", "agent-1",
                    "--policy", "agent").strip()
        env_file = cli("env", "--config", str(config), "--token", token, "--proxy", proxy,
                       "--ca-bundle", str(work / "certs" / "ca.crt"), "--node-preload",
                       "none")
        sandbox = dict(line.split("=", 1) for line in env_file.splitlines())
        print(f"2. the agent's environment is `sandbox-gateway env` output only: "
              f"{len(sandbox)} variables, OPENAI_API_KEY={token[:16]}... (its token)")
        run = subprocess.run([sys.executable, str(HERE / "agent.py")], capture_output=True,
                             text=True, timeout=60, cwd=work,
                             env={"PATH": os.environ.get("PATH", ""), "HOME": str(work),
                                  **sandbox})
        if run.returncode != 0:
            print(run.stderr, file=sys.stderr)
            return 1
        seen = json.loads(run.stdout)
        print(f"3. agent: chat.completions.create -> {seen['reply']!r}")
        got = provider.seen_authorization
        swapped = got == [f"Bearer {REAL_KEY}"] and seen["key_the_agent_holds"] == token
        print(f"   upstream saw the real key ({REAL_KEY[:12]}...); the agent held only its "
              f"token ({token[:16]}...)" if swapped else f"   UNEXPECTED: upstream saw {got}")
        refused = "403 policy_denied" in seen["evil"]
        print(f"4. agent: POST https://evil.example/upload -> refused: {seen['evil']}")
    finally:
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(15)
        provider.stop()
    audit = [json.loads(line) for line in (work / "audit.jsonl").read_text().splitlines()
             if line.startswith("{")]
    print("5. the gateway's audit lines:")
    for r in audit:
        print(f"   {r['decision']:5} {r['method']:7} {r['host']}{r.get('path') or ''}  "
              f"status={r['status']} credential={r['credential']} error={r['error']}")
    leaked = any(token in a or REAL_KEY in a for a in (work / "audit.jsonl").read_text()
                 .splitlines())
    ok = swapped and refused and not leaked and len(audit) >= 2
    print("demo OK" if ok else "demo FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
