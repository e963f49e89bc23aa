"""A coding agent's chat request as the OpenAI Python SDK sends one: the bench's
``post_agent`` workload (issue 43: what detection costs on ordinary traffic, not only on
bodies the gate passes whole).

The head carries the SDK's fields and two values new on every request (a W3C
``traceparent``, an ``Idempotency-Key``); the body is a chat of about 16 KB: a system
prompt, the user's ask, and a file the agent read, as a tool result. The file is Python's
own ``json/decoder.py`` (code: names, paths, escapes, words such as "ESCAPE" that hold a
detector's anchor; the same on every run of one Python). No credential is in it.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

SDK_FIELDS = (
    ("Accept", "application/json"), ("Content-Type", "application/json"),
    ("User-Agent", "OpenAI/Python 1.54.3"), ("X-Stainless-Lang", "python"),
    ("X-Stainless-Package-Version", "1.54.3"), ("X-Stainless-OS", "Linux"),
    ("X-Stainless-Arch", "x64"), ("X-Stainless-Runtime", "CPython"),
    ("X-Stainless-Runtime-Version", "3.12.1"), ("X-Stainless-Retry-Count", "0"),
    ("X-Stainless-Read-Timeout", "600"))


@cache
def agent_body() -> bytes:
    """The chat request's body (built once a process)."""
    source = (Path(json.__file__).parent / "decoder.py").read_text()
    call = "call_" + "Xy7Qz3abCDef12Gh"
    messages = [
        {"role": "system", "content": "You are a coding agent working in a repository. "
                                      "Read files before you change them."},
        {"role": "user", "content": "The JSON decoder rejects a valid document; find why."},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call, "type": "function", "function": {
                "name": "read_file", "arguments": json.dumps({"path": "json/decoder.py"})}}]},
        {"role": "tool", "tool_call_id": call, "content": source},
    ]
    return json.dumps({"model": "gpt-4o", "messages": messages, "stream": True,
                       "tools": [{"type": "function", "function": {
                           "name": "read_file", "parameters": {
                               "type": "object",
                               "properties": {"path": {"type": "string"}}}}}]}).encode()


def agent_request(host: str, path: str) -> bytes:
    """One request: the SDK's head with a new trace id and idempotency key, the body."""
    body = agent_body()
    ids = os.urandom(40).hex()
    fields = "".join(f"{k}: {v}\r\n" for k, v in SDK_FIELDS)
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{fields}"
            f"traceparent: 00-{ids[:32]}-{ids[32:48]}-01\r\n"
            f"Idempotency-Key: stainless-python-retry-{ids[48:56]}-{ids[56:60]}-"
            f"{ids[60:64]}-{ids[64:68]}-{ids[68:80]}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body
