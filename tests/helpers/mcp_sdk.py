"""The official MCP SDK's client for a whole test module from one process
(`mcp_client.py --serve`): its imports took a second or more each time a test started a
client process of its own. Each session is still configured by its environment only
(HTTPS_PROXY, SSL_CERT_FILE: made into the process's environment while the session's
HTTP client is made), and sessions may overlap (a client held while the test consents)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

from helpers.python_clients import mcp_python

CLIENT = Path(__file__).resolve().parent / "mcp_client.py"


class SdkClients:
    """Started by the first `ask`; `close` at the module's end (a module fixture)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.answers: dict[int, dict[str, Any]] = {}
        self.answered = threading.Condition(self.lock)
        self.reader: threading.Thread | None = None

    def _start(self) -> subprocess.Popen[str]:
        env = {k: v for k, v in os.environ.items() if "PROXY" not in k.upper()}
        proc = subprocess.Popen([str(mcp_python()), str(CLIENT), "--serve"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=env)
        self.reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.reader.start()
        return proc

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            answer = json.loads(line)
            with self.answered:
                self.answers[int(answer["id"])] = answer
                self.answered.notify_all()

    def ask(self, url: str, steps: list[dict[str, Any]], env: dict[str, str],
            transport: str = "streamable") -> int:
        """Start a session of `steps` on `url` (its environment `env`); its id."""
        with self.lock:
            if self.proc is None:
                self.proc = self._start()
            assert self.proc.stdin is not None
            ident = next(self.ids)
            self.proc.stdin.write(json.dumps({"id": ident, "url": url, "steps": steps,
                                              "env": env, "transport": transport}) + "\n")
            self.proc.stdin.flush()
        return ident

    def answer(self, ident: int, timeout: float = 90) -> dict[str, Any]:
        """Session `ident`'s answer: its `results`, or the `error` that ended it."""
        with self.answered:
            assert self.answered.wait_for(lambda: ident in self.answers, timeout), \
                "the SDK's client did not answer"
            return self.answers.pop(ident)

    def run(self, url: str, steps: list[dict[str, Any]], env: dict[str, str],
            transport: str = "streamable", timeout: float = 90) -> list[dict[str, Any]]:
        """One session to its end: its results (a session that failed fails the test)."""
        answer = self.answer(self.ask(url, steps, env, transport), timeout)
        assert "results" in answer, answer.get("error")
        results: list[dict[str, Any]] = answer["results"]
        return results

    def close(self) -> None:
        with self.lock:
            proc, self.proc = self.proc, None
        if proc is None:
            return
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        if self.reader is not None:
            self.reader.join(10)
        proc.stdout.close()
