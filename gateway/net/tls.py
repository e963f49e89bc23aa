"""TLS over memory buffers, for the HTTP/1 engine (`gateway.engines.h1`).

The stdlib `ssl.SSLObject` runs OpenSSL on two memory BIOs: ciphertext read from a
transport is fed in, plaintext comes out, and whatever OpenSSL wants to send is
drained to the transport. Both sides of an intercepted tunnel use it — the sandbox
side with a leaf certificate from the gateway CA, the upstream side verifying the
real server — so no per-connection 256 KiB buffer (asyncio's SSL transport keeps
one) and no pyOpenSSL call overhead.

`LeafContexts` makes one server `SSLContext` per destination host from mitmproxy's
certificate store (the same leaves mitmproxy would serve) and keeps it. Every sandbox
session is opened on one shared *front* context and then given its host's leaf context
(OpenSSL's `SSL_set_SSL_CTX`, what an SNI callback does): session tickets are sealed with
the front context's key, so a sandbox resumes its TLS session on any host the worker
serves (no certificate signature, no key exchange on the leaf's key), and the key is
replaced every `TICKET_KEY_LIFETIME` (a new front context; older tickets then fall back
to a full handshake). The key is this worker's: another worker cannot open its tickets
(Python's `ssl` has no call to set a ticket key), so a connection the kernel hands to
another worker gets a full handshake. A resumed session carries no identity: the
tunnel's CONNECT (its Proxy-Authorization) and each request's credentials are checked as
on a full handshake.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import ssl
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from mitmproxy import certs

from gateway.net.ca import MITMPROXY_BASENAME
from gateway.net.roots import verifying_context

READ_SIZE = 64 * 1024
# Ciphertext fed at once from which its records' plaintext is read into one buffer
# (`TlsPump._read_into`) instead of a bytes object per record joined afterwards.
BULK = 32 * 1024
RECORD = 16 * 1024  # the most plaintext a TLS record holds
TICKET_KEY_LIFETIME = 3600.0  # seconds a front context (its session ticket key) is used


class TlsClosed(Exception):
    """The peer ended the TLS session (close_notify) or it failed."""


def _nowhere(data: bytes) -> None:
    """Where a detached session's ciphertext goes."""


class TlsPump:
    """One TLS session on memory BIOs. `feed()` takes ciphertext and returns the
    plaintext it yields; `send()` encrypts; both pass ciphertext to `write`."""

    __slots__ = ("_held", "_in", "_out", "established", "obj", "peer_closed", "write")

    def __init__(self, context: ssl.SSLContext, write: Callable[[bytes], None], *,
                 server_side: bool, server_hostname: str | None = None,
                 leaf: ssl.SSLContext | None = None) -> None:
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self.obj = context.wrap_bio(self._in, self._out, server_side=server_side,
                                    server_hostname=server_hostname)
        if leaf is not None:  # the certificate (and ALPN) of this host; tickets: `context`
            self.obj.context = leaf
        self.write = write
        self.established = False
        self.peer_closed = False  # close_notify received (with the data before it)
        # Server side: TLS 1.3 session tickets held back until the first bytes this side
        # sends (see `_handshake`); None once there is nothing more to hold.
        self._held: bytes | None = b"" if server_side else None

    def start(self) -> None:
        """Client side: send the ClientHello."""
        self._handshake()

    def _flush(self) -> None:
        if self._out.pending:
            if self._held:  # the tickets go first, in front of what follows them
                data = self._held + self._out.read()
                self._held = None
                self.write(data)
            else:
                self.write(self._out.read())

    def _handshake(self) -> None:
        try:
            self.obj.do_handshake()
        except ssl.SSLWantReadError:
            pass
        else:
            self.established = True
            if self._held is not None and self._out.pending \
                    and self.obj.version() == "TLSv1.3":
                # What a TLS 1.3 server writes once the client's Finished is in is only its
                # session tickets. Sent now, they would reach a client that may already be
                # writing its request from another thread (the websockets sync client reads
                # and writes one SSLSocket from two: about one session in a few hundred
                # hung). Sent in front of the response, they arrive once the request is
                # written: an HTTP/1 client reads them with the answer it waits for.
                self._held = self._out.read()
        finally:
            self._flush()

    def feed(self, data: bytes) -> bytes | bytearray:
        """Ciphertext in, plaintext out (b"" while handshaking). Raises TlsClosed when
        the session ends and ssl.SSLError when it is broken (bad certificate, …)."""
        self._in.write(data)
        if not self.established:
            self._handshake()
            if not self.established:
                return b""
        if len(data) >= BULK:
            return self._read_into()
        chunks: list[bytes] = []
        try:
            while True:
                chunk = self.obj.read(READ_SIZE)
                if not chunk:  # close_notify: what came before it is still delivered
                    if chunks:
                        self.peer_closed = True
                        break
                    raise TlsClosed("TLS session closed")
                chunks.append(chunk)
                if not self._in.pending and not self.obj.pending():
                    break  # all fed bytes read: another read would only say "want read"
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:
            if chunks:
                self.peer_closed = True
                self._flush()
                return b"".join(chunks)
            raise TlsClosed("TLS session closed") from None
        finally:
            self._flush()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _read_into(self) -> bytearray:
        """`feed` for a bulk of ciphertext (many records): each record's plaintext read
        straight into one buffer instead of a bytes object per record joined afterwards
        (an allocation per 16 KiB record and a copy of every byte: ~0.15 ms of CPU per
        MB, measured in process, 2026-11-29). The buffer holds what the ciphertext can
        yield: the bytes in the BIO, those decrypted and not read, and a record whose
        start OpenSSL already took from the BIO (at most `RECORD` of plaintext); it grows
        if that ever falls short."""
        buf = bytearray(self._in.pending + self.obj.pending() + RECORD)
        view = memoryview(buf)
        got = 0
        try:
            while True:
                if got == len(buf):  # (not expected: see the docstring)
                    view.release()
                    buf += bytes(RECORD)
                    view = memoryview(buf)
                # (with a buffer, read returns a count: typeshed says bytes)
                n: int = self.obj.read(len(buf) - got, view[got:])  # type: ignore[assignment]
                if not n:  # close_notify: what came before it is still delivered
                    if got:
                        self.peer_closed = True
                        break
                    raise TlsClosed("TLS session closed")
                got += n
                if not self._in.pending and not self.obj.pending():
                    break  # all fed bytes read: another read would only say "want read"
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:
            if not got:
                raise TlsClosed("TLS session closed") from None
            self.peer_closed = True
        finally:
            view.release()
            self._flush()
        del buf[got:]
        return buf

    def detach(self) -> None:
        """The transport is gone: ciphertext goes nowhere from now on (and the session
        holds no reference back to its owner, whose `write` it was)."""
        self.write = _nowhere

    def send(self, data: bytes | memoryview) -> None:
        """Encrypt `data` and write it out."""
        if data:
            self.obj.write(data)
            self._flush()

    def close(self) -> None:
        """Send close_notify (best effort), behind the tickets if they are still held
        (records are numbered: what was sealed cannot be left out)."""
        with contextlib.suppress(ssl.SSLError, ValueError):
            self.obj.unwrap()
        self._flush()

    @property
    def alpn(self) -> str | None:
        return self.obj.selected_alpn_protocol()


def upstream_context(*cafiles: Path) -> ssl.SSLContext:
    """Verifying client context for upstreams (`cafiles`: the public roots +
    network.upstream_ca, `roots.public_roots`), offering HTTP/1.1; made once a process
    (`gateway/net/roots.py`)."""
    return verifying_context(*cafiles, alpn=("http/1.1",))


class LeafContexts:
    """Server contexts with a leaf certificate per destination host, signed by the
    gateway CA through mitmproxy's certificate store (bounded, least recent out)."""

    def __init__(self, store: certs.CertStore, runtime: Path, limit: int = 1000, *,
                 ticket_key_lifetime: float = TICKET_KEY_LIFETIME,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.limit = limit
        self._contexts: OrderedDict[str, ssl.SSLContext] = OrderedDict()
        self.ticket_key_lifetime = ticket_key_lifetime
        self._clock = clock
        self._front = _front_context()
        self._front_since = clock()
        # The leaf key lives (0600, in a private 0700 directory) in the runtime directory,
        # beside the mitmproxy-ca.pem mitmproxy itself reads: `load_cert_chain` takes paths.
        self._dir = tempfile.TemporaryDirectory(prefix="leaves-", dir=runtime)
        key = store.default_privatekey.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption())
        self._key = Path(self._dir.name) / "leaf.key"
        fd = os.open(self._key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)

    @classmethod
    def from_confdir(cls, confdir: Path, runtime: Path) -> LeafContexts:
        """Leaves signed by the CA in mitmproxy's `confdir` (`ca.mitmproxy_confdir`),
        from a certificate store of the HTTP/1 engine's own (mitmproxy, started only
        when needed, reads the same CA into its own). The key size is what mitmproxy
        would make a missing CA with; the CA is never missing here."""
        return cls(certs.CertStore.from_store(confdir, MITMPROXY_BASENAME, key_size=2048),
                   runtime)

    def server(self, host: str, write: Callable[[bytes], None]) -> TlsPump:
        """The sandbox side of a tunnel to `host`: the current front context (its ticket
        key) with `host`'s leaf certificate."""
        now = self._clock()
        if now - self._front_since >= self.ticket_key_lifetime:
            self._front = _front_context()  # a new random ticket key; sessions open keep theirs
            self._front_since = now
        return TlsPump(self._front, write, server_side=True, leaf=self.get(host))

    @property
    def front(self) -> ssl.SSLContext:
        """The context whose key seals the session tickets now."""
        return self._front

    def get(self, host: str) -> ssl.SSLContext:
        context = self._contexts.get(host)
        if context is not None:
            self._contexts.move_to_end(host)
            return context
        context = self._contexts[host] = self._make(host)
        if len(self._contexts) > self.limit:
            self._contexts.popitem(last=False)
        return context

    def _make(self, host: str) -> ssl.SSLContext:
        try:
            san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            san = x509.DNSName(host)
        entry = self.store.get_cert(host, [san], None)
        chain = entry.cert.to_pem() + b"".join(c.to_pem() for c in entry.chain_certs)
        path = Path(self._dir.name) / f"leaf-{len(self._contexts)}-{os.getpid()}.pem"
        path.write_bytes(chain)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(path, self._key)
        path.unlink()
        context.set_alpn_protocols(["http/1.1"])
        # A session on this context alone sends no tickets; `server()` opens sessions on
        # the front context, which does (and `TlsPump` holds them until the response).
        context.num_tickets = 0
        return context

    def close(self) -> None:
        self._dir.cleanup()


def _front_context() -> ssl.SSLContext:
    """The context a sandbox session is opened on, before its leaf is set: what OpenSSL
    takes from it is the ticket key (random, made with the context), the protocol floor
    and the number of TLS 1.3 tickets; the certificate and ALPN come from the leaf."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    # One ticket a handshake (OpenSSL's default is two): a client resumes with one, and
    # each ticket costs the server a sealing. TLS 1.2 tickets are on by default.
    context.num_tickets = 1
    return context
