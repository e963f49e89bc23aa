"""A real, throwaway `redis-server` on 127.0.0.1 for tests (no persistence, own tmp dir).

`redis-server` missing is a test failure, not a skip: `make tools` installs it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))  # up (maybe locked)
    except OSError:
        return False


class RedisServer:
    """One redis-server process; `stop()` and `start()` again keep the same port."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: run `make tools` "
                        "(scripts/test-tools.sh installs it)", pytrace=False)
        self.binary = binary
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.start_args: list[str] = []  # extra redis-server arguments for the next start

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        """Start on `self.port` and wait until it answers PING."""
        log = (self.directory / "redis.log").open("ab")
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.directory),
             "--protected-mode", "no", *self.start_args],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.directory)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                text = (self.directory / "redis.log").read_text(errors="replace")
                raise RuntimeError(f"redis-server exited ({self.process.returncode}):\n{text}")
            if _pong(self.port):
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer PING on port {self.port}")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait for it."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        self.process = None


def running_redis(directory: Path) -> Iterator[RedisServer]:
    """Fixture body: a started server, stopped afterwards."""
    server = RedisServer(directory)
    server.start()
    try:
        yield server
    finally:
        server.stop()
