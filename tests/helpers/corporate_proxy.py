"""Real corporate proxies on 127.0.0.1 for the upstream-proxy tests.

`Squid` (Debian squid): Basic auth through its `basic_ncsa_auth` helper (an htpasswd
file made with `openssl passwd -apr1`), CONNECT allowed only to the given ports, an
ACL denying the `denied` addresses (403), names resolved from its own `hosts_file`
(what "the corporate side's DNS" answers), every transaction in `access.log`.
`Dante` (Debian dante-server, `danted`): SOCKS5 with username/password, checked
against a system account the fixture creates (dante's `username` method reads the
system's password database), every connection in its log.
`Stunnel` (Debian stunnel4): TLS in front of a squid, with a leaf from the test CA: an
`https://` corporate proxy. All run in the foreground as children, with their files
under the given directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

USER = "corpuser"
PASSWORD = "corp-proxy-pass-8c1f2e9a"  # what must never reach an upstream or the sandbox
SOCKS_USER = "gwsockstest"
SOCKS_PASSWORD = "socks-pass-51d0c7b3"

SQUID_CONF = """\
http_port 127.0.0.1:{port}
visible_hostname corp-squid
pid_filename {d}/squid.pid
cache_log {d}/cache.log
access_log stdio:{d}/access.log squid
logfile_rotate 0
buffered_logs off
cache_store_log none
coredump_dir {d}
netdb_filename none
pinger_enable off
cache deny all
cache_mem 8 MB
hosts_file {d}/hosts
dns_nameservers 127.0.0.1
shutdown_lifetime 0 seconds
auth_param basic program {helper} {d}/passwd
auth_param basic realm corp
acl authed proxy_auth REQUIRED
acl CONNECT method CONNECT
acl upstream_ports port {ports}
acl denied_dst dst {denied}
http_access deny !authed
http_access deny denied_dst
http_access allow CONNECT upstream_ports
http_access deny all
"""

DANTE_CONF = """\
logoutput: {d}/danted.log
internal: 127.0.0.1 port = {port}
external: 127.0.0.1
socksmethod: username
clientmethod: none
user.privileged: root
user.unprivileged: nobody
client pass {{
  from: 127.0.0.0/8 to: 0.0.0.0/0
  log: error
}}
socks pass {{
  from: 127.0.0.0/8 to: 127.0.0.0/8
  command: connect
  log: connect error
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {log.read_text(errors='replace')[-1500:]}"
                               if log.exists() else f"{what} exited")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen within 15 s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class Squid:
    """A started squid: `port`, `url`, `access_lines()`, `stop()`."""

    def __init__(self, workdir: Path, *, ports: list[int], denied: list[str],
                 hosts: dict[str, str]) -> None:
        binary = shutil.which("squid") or "/usr/sbin/squid"
        helper = Path("/usr/lib/squid/basic_ncsa_auth")
        if not Path(binary).exists() or not helper.exists():
            raise RuntimeError("squid is not installed (scripts/test-tools.sh installs it)")
        self.dir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        # Started as root, squid drops to its effective user (proxy): it must reach its
        # files (traverse-only on the directories above) and write its logs here.
        for parent in workdir.parents:
            if parent == Path(tempfile.gettempdir()) or parent == parent.parent:
                break
            os.chmod(parent, parent.stat().st_mode | 0o011)
        os.chmod(workdir, 0o777)
        hashed = subprocess.run(["openssl", "passwd", "-apr1", PASSWORD], check=True,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        (workdir / "passwd").write_text(f"{USER}:{hashed}\n")
        (workdir / "passwd").chmod(0o644)
        (workdir / "hosts").write_text("".join(f"{ip} {name}\n" for name, ip in hosts.items()))
        self.port = free_port()
        (workdir / "squid.conf").write_text(SQUID_CONF.format(
            port=self.port, d=workdir, helper=helper, ports=" ".join(map(str, ports)),
            denied=" ".join(denied)))
        self._out = (workdir / "squid.out").open("wb")
        self.proc = subprocess.Popen([binary, "-N", "-f", str(workdir / "squid.conf")],
                                     stdin=subprocess.DEVNULL, stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        _wait_port(self.port, self.proc, "squid", workdir / "cache.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def access_lines(self) -> list[str]:
        path = self.dir / "access.log"
        return path.read_text(errors="replace").splitlines() if path.exists() else []

    def wait_access(self, needle: str, timeout: float = 5.0) -> list[str]:
        """Access-log lines containing `needle` (squid writes a CONNECT's line when the
        tunnel closes)."""
        deadline = time.monotonic() + timeout
        while True:
            found = [line for line in self.access_lines() if needle in line]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    def stop(self) -> None:
        _stop(self.proc)
        self._out.close()


STUNNEL_CONF = """\
foreground = yes
pid =
output = {d}/stunnel.log
debug = 6
[proxy]
accept = 127.0.0.1:{port}
connect = 127.0.0.1:{target}
cert = {cert}
key = {key}
"""


class Stunnel:
    """A started stunnel4 terminating TLS (a `cert`/`key` for `localhost`) in front of
    127.0.0.1:`target`: `port`, `url`, `log_lines()`, `stop()`."""

    def __init__(self, workdir: Path, *, target: int, cert: Path, key: Path) -> None:
        binary = shutil.which("stunnel4") or shutil.which("stunnel")
        if binary is None:
            raise RuntimeError("stunnel4 is not installed (scripts/test-tools.sh installs it)")
        self.dir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        conf = workdir / "stunnel.conf"
        conf.write_text(STUNNEL_CONF.format(d=workdir, port=self.port, target=target,
                                            cert=cert, key=key))
        self._out = (workdir / "stunnel.out").open("wb")
        self.proc = subprocess.Popen([binary, str(conf)], stdin=subprocess.DEVNULL,
                                     stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        _wait_port(self.port, self.proc, "stunnel", workdir / "stunnel.log")

    @property
    def url(self) -> str:
        return f"https://localhost:{self.port}"

    def log_lines(self) -> list[str]:
        path = self.dir / "stunnel.log"
        return path.read_text(errors="replace").splitlines() if path.exists() else []

    def stop(self) -> None:
        _stop(self.proc)
        self._out.close()


def ensure_socks_account() -> None:
    """The system account dante's `username` method checks (created once)."""
    if subprocess.run(["id", SOCKS_USER], capture_output=True, timeout=10).returncode != 0:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        SOCKS_USER], check=True, capture_output=True, timeout=10)
    subprocess.run(["chpasswd"], input=f"{SOCKS_USER}:{SOCKS_PASSWORD}\n", text=True,
                   check=True, capture_output=True, timeout=10)


class Dante:
    """A started danted: `port`, `url`, `log_lines()`, `stop()`."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("danted") or "/usr/sbin/danted"
        if not Path(binary).exists():
            raise RuntimeError("dante-server is not installed (scripts/test-tools.sh "
                               "installs it)")
        ensure_socks_account()
        self.dir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        conf = workdir / "danted.conf"
        conf.write_text(DANTE_CONF.format(d=workdir, port=self.port))
        self._out = (workdir / "danted.out").open("wb")
        self.proc = subprocess.Popen([binary, "-f", str(conf), "-N", "1",
                                      "-p", str(workdir / "danted.pid")],
                                     stdin=subprocess.DEVNULL, stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        _wait_port(self.port, self.proc, "danted", workdir / "danted.out")

    @property
    def url(self) -> str:
        return f"socks5://127.0.0.1:{self.port}"

    def log_lines(self) -> list[str]:
        path = self.dir / "danted.log"
        return path.read_text(errors="replace").splitlines() if path.exists() else []

    def stop(self) -> None:
        _stop(self.proc)
        self._out.close()
