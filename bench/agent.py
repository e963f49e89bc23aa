"""A coding agent's chat request as the OpenAI Python SDK sends one: the bench's
``post_agent`` workload (issue 43: what detection costs on ordinary traffic, not only on
bodies the gate passes whole).

The head carries the SDK's fields and two values new on every request (a W3C
``traceparent``, an ``Idempotency-Key``). The body is a chat of about 15 KB, as an agent
sends it at each turn: its history, the same every request (a system prompt, the user's
ask, and a file the agent read, as a tool result: Python's own ``json/decoder.py``, code
with names, paths, escapes and words such as "ESCAPE" that hold a detector's anchor), and
a new turn (a tool call with a new id, and its result: 1.5 KB of ``json/encoder.py`` from
a random line). No credential is in it. (Until the fifteenth session the body was the
history alone, the same every request.)
"""

from __future__ import annotations

import json
import os
import random
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


@cache
def _around() -> tuple[bytes, bytes, list[str]]:
    """The body's JSON before and after the new turn, and the lines of the file the new
    turns read."""
    body = json.loads(agent_body())
    body["messages"].append({"role": "__turn__"})
    before, _, after = json.dumps(body).partition(', {"role": "__turn__"}')
    source = (Path(json.__file__).parent / "encoder.py").read_text()
    return before.encode(), after.encode(), source.splitlines(keepends=True)


def new_turn() -> bytes:
    """A tool call with a new id and its result (1.5 KB of a file from a random line),
    as the two messages' JSON (comma-led)."""
    _, _, lines = _around()
    rng = random.Random(os.urandom(8))
    call = "call_" + "".join(rng.choice(_ID) for _ in range(24))
    first = rng.randrange(len(lines) - 60)
    text = "".join(lines[first:first + 60])[:1536]
    turn = [{"role": "assistant", "content": None, "tool_calls": [{
        "id": call, "type": "function", "function": {
            "name": "read_file",
            "arguments": json.dumps({"path": "json/encoder.py", "line": first})}}]},
        {"role": "tool", "tool_call_id": call, "content": text}]
    return b", " + json.dumps(turn)[1:-1].encode()


_ID = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def agent_request(host: str, path: str) -> bytes:
    """One request: the SDK's head with a new trace id and idempotency key, the history
    and a new turn."""
    before, after, _ = _around()
    body = before + new_turn() + after
    ids = os.urandom(40).hex()
    fields = "".join(f"{k}: {v}\r\n" for k, v in SDK_FIELDS)
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{fields}"
            f"traceparent: 00-{ids[:32]}-{ids[32:48]}-01\r\n"
            f"Idempotency-Key: stainless-python-retry-{ids[48:56]}-{ids[56:60]}-"
            f"{ids[60:64]}-{ids[64:68]}-{ids[68:80]}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def agent_body_size() -> int:
    """About the bytes of one request's body (the history and a new turn)."""
    before, after, _ = _around()
    return len(before) + len(after) + len(new_turn())
