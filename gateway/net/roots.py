"""The verifying client contexts of the gateway's own TLS clients: the public roots
(certifi) plus `network.upstream_ca`.

The HTTP/1 engine's upstream side, the token endpoints' client, ask mode's webhooks, MCP
OAuth, Key Vault and an HTTPS upstream proxy all verify servers against the same roots.
Parsing them takes 75 ms (OpenSSL 3, ~120 certificates), and each client made its own:
five parses at every start of a gateway process (and of each of its workers). Here a
context is made once a process for the same files as they are on disk (path, size and
modification time: a CA file replaced in place gives a new context) and shared; nothing
changes a context after it is made (sharing one between connections is what `ssl` is
made for).
"""

from __future__ import annotations

import functools
import ssl
from pathlib import Path

import certifi

__all__ = ["public_roots", "verifying_context"]

# A file as it is on disk: (path, size, modification time in ns).
_Version = tuple[str, int, int]


def public_roots(upstream_ca: Path | None = None) -> tuple[Path, ...]:
    """The CA files a client of the gateway trusts: certifi's bundle, then
    `network.upstream_ca` when set."""
    return (Path(certifi.where()),) + ((upstream_ca,) if upstream_ca is not None else ())


def verifying_context(*cafiles: Path, alpn: tuple[str, ...] = ()) -> ssl.SSLContext:
    """A client context (hostname checked, certificate required) trusting the CAs of
    `cafiles`, offering `alpn`; the same object for the same files and `alpn` until a
    file changes. A file that cannot be read raises OSError, one that holds no
    certificate ssl.SSLError, as `load_verify_locations` does."""
    if not cafiles:
        raise ValueError("verifying_context needs at least one CA file")
    versions = []
    for path in cafiles:
        stat = path.stat()
        versions.append((str(path), stat.st_size, stat.st_mtime_ns))
    return _made(tuple(versions), alpn)


@functools.lru_cache(maxsize=16)
def _made(versions: tuple[_Version, ...], alpn: tuple[str, ...]) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=versions[0][0])
    for path, _, _ in versions[1:]:
        context.load_verify_locations(cafile=path)
    if alpn:
        context.set_alpn_protocols(list(alpn))
    return context
