"""A raw client for the parity suite: one request, exactly as specified, over any engine.

Sends what a test asks for byte by byte — absolute-form targets, a foreign Host, an
SNI of its choosing, trailers, HTTP/2 with any `:authority` — through the proxy
(CONNECT, or a plain proxy request) or straight to an address (transparent mode,
where the sandbox's connection is redirected). Reports what the client saw: the stage
it stopped at (`connect`, `tls`, `response`), the status, the refusal code and the
body. Runs in-process, or as a script inside a sandbox network namespace:
`python parity.py '<json spec>'` (or `-`: the spec on stdin) prints the JSON result;
`python parity.py --serve` answers a spec a line until its stdin ends.
"""

from __future__ import annotations

import base64
import contextlib
import glob
import json
import socket
import ssl
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Spec:
    host: str  # the destination name (SNI, Host, CONNECT authority default)
    port: int = 443
    method: str = "GET"
    target: str = "/"  # request-target as sent
    headers: list[tuple[str, str]] = field(default_factory=list)  # Host added unless given
    body: str = ""  # base64
    chunked: bool = False  # send the body chunked (with `trailers`)
    first_chunk: int = 0  # chunked (HTTP/2: a DATA frame): send this many bytes first, alone
    trailers: list[tuple[str, str]] = field(default_factory=list)
    tls: bool = True
    sni: str | None = None  # default: host
    h2: bool = False  # ALPN h2 only, HTTP/2 framing
    authority: str | None = None  # HTTP/2 :authority (default host)
    proxy: tuple[str, int] | None = None  # the gateway's proxy listener
    connect_to: tuple[str, int] | None = None  # transparent: dial this address instead
    connect_authority: str | None = None  # CONNECT target (default host:port)
    proxy_auth: str | None = None  # Proxy-Authorization value
    source: str | None = None  # the client's source address (a pod's, identity.kubernetes)
    plain_proxy: bool = False  # no CONNECT: an absolute-form request to the proxy
    cafile: str | None = None
    timeout: float = 10.0
    ws: list[str] = field(default_factory=list)  # WebSocket text messages to send after a 101


@dataclass
class Result:
    stage: str  # where it ended: connect (refused at CONNECT), tls, response, closed;
    # after a WebSocket upgrade: ws-echo (messages came back), ws-closed (the gateway
    # closed the session: a close frame or the connection's end), ws-nothing (none came
    # back within the wait, the session open)
    status: int | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: str = ""


def _code(headers: dict[str, str]) -> str | None:
    return headers.get("x-sandbox-gateway-error")


def _read_head(sock: Any) -> tuple[int, dict[str, str], bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} bytes")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, rest


def _read_body(sock: Any, headers: dict[str, str], rest: bytes) -> bytes:
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(rest) < n:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return rest[:n]
    if "chunked" in headers.get("transfer-encoding", ""):
        out, buf = b"", rest
        while True:
            while b"\r\n" not in buf:
                chunk = sock.recv(65536)
                if not chunk:
                    return out
                buf += chunk
            line, _, buf = buf.partition(b"\r\n")
            size = int(line.split(b";")[0], 16)
            if size == 0:
                return out
            while len(buf) < size + 2:
                chunk = sock.recv(65536)
                if not chunk:
                    return out + buf
                buf += chunk
            out, buf = out + buf[:size], buf[size + 2:]
    out = rest
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _h1_request(spec: Spec) -> list[bytes]:
    """The request's bytes, in the writes to make (a `first_chunk` is a write alone)."""
    body = base64.b64decode(spec.body)
    headers = list(spec.headers)
    if not any(k.lower() == "host" for k, _ in headers):
        headers.insert(0, ("Host", spec.host if spec.port in (80, 443)
                           else f"{spec.host}:{spec.port}"))
    if spec.plain_proxy and spec.proxy_auth:
        headers.append(("Proxy-Authorization", spec.proxy_auth))
    if spec.chunked:
        headers.append(("Transfer-Encoding", "chunked"))
        if spec.trailers:
            headers.append(("Trailer", ", ".join(k for k, _ in spec.trailers)))
    elif body or spec.method in ("POST", "PUT"):
        headers.append(("Content-Length", str(len(body))))
    out = f"{spec.method} {spec.target} HTTP/1.1\r\n".encode()
    out += b"".join(f"{k}: {v}\r\n".encode() for k, v in headers) + b"\r\n"
    writes = []
    if spec.chunked:
        first, body = body[:spec.first_chunk], body[spec.first_chunk:]
        if first:
            writes.append(out + b"%x\r\n%s\r\n" % (len(first), first))
            out = b""
        if body:
            out += b"%x\r\n%s\r\n" % (len(body), body)
        out += b"0\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in spec.trailers) + b"\r\n"
    else:
        out += body
    return [*writes, out]


def _connect(spec: Spec) -> tuple[socket.socket, Result | None]:
    if spec.proxy is not None:
        sock = socket.create_connection(spec.proxy, timeout=spec.timeout,
                                        source_address=(spec.source, 0) if spec.source
                                        else None)
        if spec.plain_proxy:
            return sock, None
        authority = spec.connect_authority or f"{spec.host}:{spec.port}"
        lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
        if spec.proxy_auth:
            lines.append(f"Proxy-Authorization: {spec.proxy_auth}")
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        status, headers, rest = _read_head(sock)
        if status != 200:
            body = _read_body(sock, headers, rest)
            sock.close()
            return sock, Result("connect", status, _code(headers), headers,
                                body.decode("latin-1"))
        return sock, None
    assert spec.connect_to is not None
    return socket.create_connection(spec.connect_to, timeout=spec.timeout), None


def run(spec: Spec) -> Result:
    """Send the request; what the client saw."""
    try:
        sock, refused = _connect(spec)
    except (OSError, ConnectionError):
        return Result("closed")
    if refused is not None:
        return refused
    conn: Any = sock
    try:
        if spec.tls:
            ctx = ssl.create_default_context(cafile=spec.cafile)
            ctx.check_hostname = False  # the parity cases send SNIs of their choosing
            ctx.set_alpn_protocols(["h2"] if spec.h2 else ["http/1.1"])
            try:
                conn = ctx.wrap_socket(sock, server_hostname=spec.sni or spec.host)
            except (OSError, ssl.SSLError):
                return Result("tls")
        if spec.h2:
            return _h2(conn, spec)
        # (refused part-way and closed while the body was still going: the answer sent
        # before is read below; none there, "closed")
        with contextlib.suppress(OSError, ssl.SSLError):
            for i, part in enumerate(_h1_request(spec)):  # (a first chunk: a write alone)
                if i:
                    time.sleep(0.05)
                conn.sendall(part)
        try:
            status, headers, rest = _read_head(conn)
        except (OSError, ConnectionError, ssl.SSLError):
            return Result("closed")
        if spec.ws and status == 101:
            return _websocket(conn, spec, headers, rest)
        try:
            body = b"" if spec.method == "HEAD" else _read_body(conn, headers, rest)
        except (OSError, ssl.SSLError):
            body = b""
        return Result("response", status, _code(headers), headers, body.decode("latin-1"))
    finally:
        conn.close()


def _websocket(conn: Any, spec: Spec, headers: dict[str, str], rest: bytes) -> Result:
    """Send each message as one masked text (or binary) frame; collect what comes back within 1.5 s
    (an echo, or nothing: the gateway closed the connection or dropped the frame)."""
    import os
    import time

    for text in spec.ws:  # ("bin:" and base64: a binary frame of those bytes)
        binary = text.startswith("bin:")
        data = base64.b64decode(text[4:]) if binary else text.encode()
        mask = os.urandom(4)
        size = bytes([0x80 | len(data)]) if len(data) < 126 else \
            bytes([0x80 | 126]) + len(data).to_bytes(2, "big")
        conn.sendall((b"\x82" if binary else b"\x81") + size + mask +
                     bytes(b ^ mask[i % 4] for i, b in enumerate(data)))
    echoed: list[str] = []
    buf = rest
    deadline = time.monotonic() + 1.5
    while len(echoed) < len(spec.ws) and time.monotonic() < deadline:
        while len(buf) >= 2 and len(buf) >= 2 + (buf[1] & 0x7F if buf[1] & 0x7F < 126 else 0):
            size, at = buf[1] & 0x7F, 2
            if size == 126:
                if len(buf) < 4:
                    break
                size, at = int.from_bytes(buf[2:4], "big"), 4
            if len(buf) < at + size:
                break
            opcode, payload, buf = buf[0] & 0x0F, buf[at:at + size], buf[at + size:]
            if opcode == 8:
                return Result("ws-closed", 101, None, headers, "".join(echoed))
            echoed.append(payload.decode("utf-8", "replace"))
        if len(echoed) >= len(spec.ws):
            break
        try:
            conn.settimeout(max(0.05, deadline - time.monotonic()))
            chunk = conn.recv(65536)
        except TimeoutError:
            break
        except (OSError, ssl.SSLError):
            return Result("ws-closed", 101, None, headers, "".join(echoed))
        if not chunk:
            return Result("ws-closed", 101, None, headers, "".join(echoed))
        buf += chunk
    stage = "ws-echo" if echoed else "ws-nothing"
    return Result(stage, 101, None, headers, "".join(echoed))


def _h2(conn: Any, spec: Spec) -> Result:
    import h2.config
    import h2.connection
    import h2.events

    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True,
                                                               header_encoding="utf-8"))
    h2c.initiate_connection()
    body = base64.b64decode(spec.body)
    headers = [(":method", spec.method), (":scheme", "https"),
               (":authority", spec.authority or spec.host), (":path", spec.target)]
    headers += [(k.lower(), v) for k, v in spec.headers]
    if body and not spec.chunked:  # what real clients do for a body of known size
        headers.append(("content-length", str(len(body))))
    end = not body and not spec.trailers
    h2c.send_headers(1, headers, end_stream=end)
    pending = [body]  # what the flow-control window has not let out yet
    if spec.first_chunk and body:  # (a first DATA frame alone)
        h2c.send_data(1, body[:spec.first_chunk])
        conn.sendall(h2c.data_to_send())
        time.sleep(0.05)
        pending[0] = body[spec.first_chunk:]

    def send_body() -> None:
        while pending[0]:
            room = min(h2c.local_flow_control_window(1), h2c.max_outbound_frame_size)
            if room <= 0:
                return  # (wait for a WINDOW_UPDATE)
            piece, pending[0] = pending[0][:room], pending[0][room:]
            h2c.send_data(1, piece, end_stream=not pending[0] and not spec.trailers)
        if spec.trailers:
            h2c.send_headers(1, [(k.lower(), v) for k, v in spec.trailers], end_stream=True)
            spec.trailers = []

    send_body()
    conn.sendall(h2c.data_to_send())
    status: int | None = None
    got: dict[str, str] = {}
    data = b""
    while True:
        try:
            raw = conn.recv(65536)
        except (OSError, ssl.SSLError):
            raw = b""
        if not raw:
            return Result("closed" if status is None else "response", status,
                          _code(got), got, data.decode("latin-1"))
        for event in h2c.receive_data(raw):
            if isinstance(event, h2.events.ResponseReceived):
                got = {str(k): str(v) for k, v in event.headers}
                status = int(got[":status"])
            elif isinstance(event, h2.events.DataReceived):
                data += event.data
                h2c.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.WindowUpdated) and pending[0]:
                send_body()
            elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset,
                                    h2.events.ConnectionTerminated)):
                closed = status is None
                return Result("closed" if closed else "response", status, _code(got), got,
                              data.decode("latin-1"))
        conn.sendall(h2c.data_to_send())


def spec_json(spec: Spec) -> str:
    return json.dumps(asdict(spec))


def _from_json(raw: dict[str, Any]) -> Spec:
    for key in ("proxy", "connect_to"):
        if raw.get(key) is not None:
            raw[key] = tuple(raw[key])
    raw["headers"] = [tuple(h) for h in raw.get("headers", [])]
    raw["trailers"] = [tuple(h) for h in raw.get("trailers", [])]
    return Spec(**raw)


def _answer(given: Any) -> Any:
    """The JSON result of a JSON spec (a list of them: one after the other)."""
    if isinstance(given, list):  # several requests, one after the other
        return [asdict(run(_from_json(raw))) for raw in given]
    return asdict(run(_from_json(given)))


if __name__ == "__main__":
    if sys.argv[1] == "--serve":  # a spec a line on stdin, its result a line, until EOF
        for spec_line in sys.stdin:
            print(json.dumps(_answer(json.loads(spec_line))), flush=True)
    else:
        print(json.dumps(_answer(json.loads(sys.stdin.read() if sys.argv[1] == "-"
                                            else sys.argv[1]))))


class SharedDecisions:
    """Each engine's decision fields per parity case, kept in files every test process
    of the run shares (pytest-xdist spreads one case's engines over processes), so each
    case is compared across all the engines that ran it, wherever they ran: the engine
    that finishes a case last sees every other engine's answer (each writes before it
    reads; a file appears whole, by rename)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def record(self, case: str, engine: str, fields: dict[str, Any]) -> dict[str, Any]:
        """Keep `engine`'s `fields` for `case`; every engine's so far, by engine."""
        safe = case.replace("/", "_")
        tmp = self.root / f".{safe}.{engine}.tmp"
        tmp.write_text(json.dumps(fields, sort_keys=True))
        tmp.rename(self.root / f"{safe}.{engine}.json")
        return {p.name[len(safe) + 1:-len(".json")]: json.loads(p.read_text())
                for p in self.root.glob(f"{glob.escape(safe)}.*.json")
                if p.name.count(".") == safe.count(".") + 2}


def shared_decisions(config: Any, basetemp: Path, name: str) -> SharedDecisions:
    """The run's `SharedDecisions` for suite `name`: under the base temp directory all
    the run's processes share (its parent, per run, under xdist)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # (an xdist worker: basetemp is per worker, its parent per run)
        return SharedDecisions(basetemp.parent / f"parity-{workerinput['testrunuid']}" / name)
    return SharedDecisions(basetemp / "parity" / name)
