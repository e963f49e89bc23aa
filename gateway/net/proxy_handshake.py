"""The one CONNECT through an upstream proxy, without I/O: HTTP CONNECT and SOCKS5.

`HttpConnect` and `Socks5Connect` are byte-in, byte-out state machines: `start()` gives
the first bytes to send, `feed(data)` takes what the proxy sent and gives what to send
next; once `done`, `leftover` holds bytes past the handshake (a server that speaks
first, relayed by the proxy in the same segment) for the connection's own protocol.
A refusal raises `ProxyFailed` whose reason is built from fixed sentences and the
proxy's status or reply code only: the proxy's body or headers are never quoted (they
reach the sandbox in a refusal). HTTP CONNECT: RFC 9110 9.3.6 with Basic
`Proxy-Authorization`, the request written and the answer read by h11 (its public
API), the parser every other HTTP/1 head goes through; SOCKS5: RFC 1928 with
username/password (RFC 1929).
"""

from __future__ import annotations

import base64
import ipaddress
import struct

import h11

from gateway.core.secret_value import SecretValue

__all__ = ["MAX_HEAD", "HttpConnect", "ProxyFailed", "Socks5Connect", "authority"]

MAX_HEAD = 16 * 1024  # a CONNECT answer's head larger than this is not a proxy's

SOCKS_REPLIES = {
    1: "general SOCKS server failure",
    2: "connection not allowed by ruleset",
    3: "network unreachable",
    4: "host unreachable",
    5: "connection refused",
    6: "TTL expired",
    7: "command not supported",
    8: "address type not supported",
}


class ProxyFailed(Exception):
    """The proxy did not open the tunnel. `outcome` (a metric label): `denied` (403, or
    SOCKS "not allowed"), `auth_failed` (407, SOCKS authentication), `refused` (any
    other answer), `protocol_error` (not a proxy's answer), `unreachable`, `timeout`.
    `status`: the proxy's HTTP status or SOCKS reply code."""

    def __init__(self, outcome: str, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.outcome = outcome
        self.reason = reason
        self.status = status


def authority(host: str, port: int) -> str:
    """`host:port` as a CONNECT request names it (`[v6]:port`)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class HttpConnect:
    """HTTP CONNECT to `host:port` (an address or a name), Basic credentials if given."""

    def __init__(self, host: str, port: int, credentials: SecretValue | None) -> None:
        self.target = authority(host, port)
        self.credentials = credentials
        self.done = False
        self.leftover = b""
        self._conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)

    def start(self) -> bytes:
        headers = [(b"Host", self.target.encode("ascii"))]
        if self.credentials is not None:
            token = base64.b64encode(self.credentials.reveal().encode("utf-8"))
            headers.append((b"Proxy-Authorization", b"Basic " + token))
        out = self._conn.send(h11.Request(method=b"CONNECT", target=self.target.encode(
            "ascii"), headers=headers))
        assert out is not None
        return out

    def feed(self, data: bytes) -> bytes:
        self._conn.receive_data(data)
        while True:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError:
                raise ProxyFailed("protocol_error", "the upstream proxy's answer to CONNECT "
                                  "is not an HTTP/1 head (within 16 KiB)") from None
            if event is h11.NEED_DATA:
                return b""
            if isinstance(event, h11.InformationalResponse):
                continue  # (a 1xx before the answer)
            assert isinstance(event, h11.Response)
            break
        status = event.status_code
        if status // 100 != 2:
            outcome = {403: "denied", 407: "auth_failed"}.get(status, "refused")
            why = {403: " (forbidden by the proxy's rules)",
                   407: (" (proxy authentication required: check the credentials in "
                         "network.upstream_proxy.credentials)"
                         if self.credentials is not None else
                         " (proxy authentication required: set "
                         "network.upstream_proxy.credentials)")}.get(status, "")
            raise ProxyFailed(outcome, f"the upstream proxy answered {status} to CONNECT "
                              f"{self.target}{why}", status)
        # A 2xx to CONNECT switches the connection to the tunnel: what h11 has not read
        # is the tunnel's first bytes.
        self.done = True
        self.leftover, _closed = self._conn.trailing_data
        return b""


class Socks5Connect:
    """SOCKS5 CONNECT to `host:port`: an IP literal as an address, else as a domain name;
    username/password authentication when credentials are given."""

    def __init__(self, host: str, port: int, credentials: SecretValue | None) -> None:
        self.host = host
        self.port = port
        self.credentials = credentials
        self.done = False
        self.leftover = b""
        self._buf = bytearray()
        self._state = "method"

    def start(self) -> bytes:
        methods = b"\x00\x02" if self.credentials is not None else b"\x00"
        return b"\x05" + bytes([len(methods)]) + methods

    def _take(self, n: int) -> bytes | None:
        if len(self._buf) < n:
            return None
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = b""
        while not self.done:
            step = self._step()
            if step is None:
                break
            out += step
        return out

    def _step(self) -> bytes | None:
        if self._state == "method":
            reply = self._take(2)
            if reply is None:
                return None
            if reply[0] != 5:
                raise ProxyFailed("protocol_error", "the upstream proxy does not speak SOCKS5")
            if reply[1] == 0xFF:
                raise ProxyFailed("auth_failed", "the upstream SOCKS5 proxy accepts none of "
                                  "the offered authentication methods (set or check "
                                  "network.upstream_proxy.credentials)")
            if reply[1] == 2 and self.credentials is not None:
                self._state = "auth"
                return self._auth()
            if reply[1] != 0:
                raise ProxyFailed("protocol_error", "the upstream SOCKS5 proxy chose a method "
                                  "that was not offered")
            self._state = "reply"
            return self._request()
        if self._state == "auth":
            reply = self._take(2)
            if reply is None:
                return None
            if reply[1] != 0:
                raise ProxyFailed("auth_failed", "the upstream SOCKS5 proxy refused the "
                                  "username and password (network.upstream_proxy."
                                  "credentials)", reply[1])
            self._state = "reply"
            return self._request()
        head = bytes(self._buf[:5])
        if len(head) < 5:
            return None
        if head[0] != 5:
            raise ProxyFailed("protocol_error", "the upstream proxy's SOCKS5 reply is malformed")
        if head[1] != 0:
            code = head[1]
            outcome = "denied" if code == 2 else "refused"
            raise ProxyFailed(outcome, f"the upstream SOCKS5 proxy refused CONNECT "
                              f"{authority(self.host, self.port)}: reply {code} "
                              f"({SOCKS_REPLIES.get(code, 'unknown reply')})", code)
        size = {1: 4, 4: 16, 3: 1 + head[4]}.get(head[3])
        if size is None:
            raise ProxyFailed("protocol_error", "the upstream proxy's SOCKS5 reply has an "
                              "unknown address type")
        if self._take(4 + size + 2) is None:
            return None
        self.done = True
        self.leftover = bytes(self._buf)
        self._buf.clear()
        return b""

    def _auth(self) -> bytes:
        assert self.credentials is not None
        user, _, password = self.credentials.reveal().partition(":")
        raw_user, raw_password = user.encode(), password.encode()
        if not 0 < len(raw_user) < 256 or len(raw_password) > 255:
            raise ProxyFailed("auth_failed", "the proxy credentials do not fit SOCKS5 "
                              "(user and password at most 255 bytes each)")
        return (b"\x01" + bytes([len(raw_user)]) + raw_user
                + bytes([len(raw_password)]) + raw_password)

    def _request(self) -> bytes:
        try:
            ip = ipaddress.ip_address(self.host)
        except ValueError:
            name = self.host.encode("idna")
            address = b"\x03" + bytes([len(name)]) + name
        else:
            address = (b"\x01" if ip.version == 4 else b"\x04") + ip.packed
        return b"\x05\x01\x00" + address + struct.pack("!H", self.port)
