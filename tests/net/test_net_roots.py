"""The verifying client contexts (gateway.net.roots): the public roots plus the upstream
CA, made once a process for the same files, made again when a file changes; a real TLS
handshake on memory BIOs shows what each context trusts."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import certifi
import pytest
from helpers.tls import LocalCA

from gateway.net.roots import public_roots, verifying_context


def _handshake(client: ssl.SSLContext, server: ssl.SSLContext, host: str) -> str | None:
    """A TLS handshake between `client` and `server` in memory: the ALPN protocol the
    client got (raises ssl.SSLCertVerificationError when it does not trust the server)."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    c = client.wrap_bio(c_in, c_out, server_hostname=host)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"c": False, "s": False}
    for _ in range(10):
        for name, obj in (("c", c), ("s", s)):
            if not done[name]:
                try:
                    obj.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if done["c"] and done["s"]:
            return c.selected_alpn_protocol()
    raise AssertionError("the handshake did not end")


def test_public_roots_are_certifi_then_the_upstream_ca(tmp_path: Path) -> None:
    assert public_roots() == (Path(certifi.where()),)
    assert public_roots(tmp_path / "ca.pem") == (Path(certifi.where()), tmp_path / "ca.pem")


def test_a_context_trusts_the_upstream_ca_and_is_made_once(tmp_path: Path) -> None:
    ca = LocalCA.create(tmp_path / "ca")
    server = ca.server_context(tmp_path, ["api.example.test"])
    context = verifying_context(*public_roots(ca.cert_path))
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert _handshake(context, server, "api.example.test") is None  # (no ALPN offered)
    with pytest.raises(ssl.SSLCertVerificationError):  # the name is checked
        _handshake(context, server, "other.example.test")
    assert verifying_context(*public_roots(ca.cert_path)) is context
    with_alpn = verifying_context(*public_roots(ca.cert_path), alpn=("http/1.1",))
    assert with_alpn is not context
    assert _handshake(with_alpn, server, "api.example.test") == "http/1.1"


def test_without_the_upstream_ca_its_servers_are_not_trusted(tmp_path: Path) -> None:
    ca = LocalCA.create(tmp_path / "ca")
    server = ca.server_context(tmp_path, ["api.example.test"])
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(verifying_context(*public_roots()), server, "api.example.test")


def test_a_changed_ca_file_makes_a_new_context(tmp_path: Path) -> None:
    first = LocalCA.create(tmp_path / "first")
    second = LocalCA.create(tmp_path / "second")
    path = tmp_path / "upstream-ca.pem"
    path.write_bytes(first.cert_path.read_bytes())
    old = verifying_context(*public_roots(path))
    path.write_bytes(second.cert_path.read_bytes())
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    new = verifying_context(*public_roots(path))
    assert new is not old
    server = second.server_context(tmp_path, ["api.example.test"])
    assert _handshake(new, server, "api.example.test") is None
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(old, server, "api.example.test")


def test_a_missing_or_empty_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        verifying_context(*public_roots(tmp_path / "missing.pem"))
    (tmp_path / "empty.pem").write_text("no certificate here\n")
    with pytest.raises(ssl.SSLError):
        verifying_context(tmp_path / "empty.pem")
    with pytest.raises(ValueError):
        verifying_context()
