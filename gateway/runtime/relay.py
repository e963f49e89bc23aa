"""The supervisor's relay of token revocations to its workers (`run --workers N`): a
revocation reaches every worker of the gateway at once, whatever the state store does.

The state store is how the workers share what they must agree on, and it can be away (a
full disk under the SQLite file, Redis down). A revocation must not wait for it: a token
revoked on the worker the admin API reached would otherwise keep opening tunnels on the
others until the store is back. So each worker is started with one end of a socketpair
(`--relay-fd`) whose other end the supervisor keeps (`watch.py`), and revocations go
through the supervisor to every worker, independent of any disk or network.

Messages are JSON lines:

- worker to supervisor: `hello` (once, at its start, before it serves), `revoke {id, jti,
  exp}` (relay it; the supervisor answers `done`), `ack {id}` (this worker holds relayed
  revocation `id`), `stored {jti}` (the revocation is in the state store now);
- supervisor to worker: `snapshot {revoked: [[jti, exp], ...]}` first, once (the
  revocations the state store does not have yet), `welcome` (the answer to `hello`),
  `revoke {id, jti, exp}` (hold it, then `ack`), `done {id, held, missing}` (the answer
  to a worker's `revoke`: the indexes of the workers that hold it, the worker that asked
  included, and of those that did not acknowledge within `RELAY_TIMEOUT`).

A worker reads its link up to the `welcome` before it serves: every revocation relayed
before that (the snapshot, and those queued while it started) is held by then, so the
supervisor waits for the acknowledgements of the workers that said `hello` only - a worker
still starting (seconds of imports) holds no connection yet and does not delay an answer.
The supervisor keeps a revocation until a worker says it is stored (at most until it
expires), so a worker started later - a restart - learns the revocations made while the
store was away and writes them itself. A worker that exits is no longer waited for: it
serves nothing, and the one started in its place reads the snapshot before it serves.

Standard library only (the supervisor's lean process imports it); single-threaded: the
supervisor calls `pump` where it would otherwise sleep.
"""

from __future__ import annotations

import itertools
import json
import selectors
import socket
import time
from collections.abc import Callable

TYPE_CHECKING = False  # (not `typing`'s: the supervisor never imports typing, 0.5 MiB)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["MAX_LINE", "RELAY_TIMEOUT", "Lines", "Relay", "encode"]

RELAY_TIMEOUT = 2.0  # seconds the workers have to acknowledge a revocation
MAX_LINE = 1 << 24  # bytes: a message longer than this ends the link (a snapshot of ~200k)


def encode(message: dict[str, Any]) -> bytes:
    """One message as the link carries it (a JSON line)."""
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


class Lines:
    """Splits the bytes a link receives into messages (JSON objects, one a line)."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """The whole messages `data` completes; ValueError for a line that is not a JSON
        object or is longer than `MAX_LINE`."""
        self.buffer += data
        out: list[dict[str, Any]] = []
        while (end := self.buffer.find(b"\n")) >= 0:
            line = bytes(self.buffer[:end])
            del self.buffer[:end + 1]
            message = json.loads(line)
            if not isinstance(message, dict):
                raise ValueError("a relay message is a JSON object")
            out.append(message)
        if len(self.buffer) > MAX_LINE:
            raise ValueError("a relay message is too long")
        return out


# (plain classes, not dataclasses: the supervisor imports this module, and `dataclasses`
# brings `inspect` and `ast`, 1.3 MiB of its memory; issue 41)
class _Peer:
    """The supervisor's end of one worker's link."""

    __slots__ = ("index", "lines", "live", "out", "sock", "writing")

    def __init__(self, index: int, sock: socket.socket) -> None:
        self.index = index
        self.sock = sock
        self.lines = Lines()
        self.out = bytearray()
        self.writing = False  # registered for EVENT_WRITE (output is waiting)
        self.live = False  # said `hello`: may serve, so revocations wait for its `ack`


class _Wait:
    """A revocation relayed for worker `origin` (its request `ident`), until every other
    worker has acknowledged it or `deadline` (monotonic) passes."""

    __slots__ = ("deadline", "held", "ident", "origin", "waiting")

    def __init__(self, origin: int, ident: int, waiting: set[int], held: set[int],
                 deadline: float) -> None:
        self.origin = origin
        self.ident = ident
        self.waiting = waiting
        self.held = held
        self.deadline = deadline


class Relay:
    """The supervisor's side: one link per running worker (see the module docstring)."""

    def __init__(self, timeout: float = RELAY_TIMEOUT,
                 clock: Callable[[], float] = time.time) -> None:
        self.timeout = timeout
        self.clock = clock
        self.selector = selectors.DefaultSelector()
        self.peers: dict[int, _Peer] = {}
        self.unstored: dict[str, float] = {}  # jti -> expiry: not in the state store yet
        self._waits: dict[int, _Wait] = {}
        self._ids = itertools.count(1)

    # -- links ---------------------------------------------------------------------------

    def attach(self, index: int) -> socket.socket:
        """A new link for worker `index` (its previous one, if any, is dropped), the
        snapshot queued on it; returns the worker's end, to pass to the worker process
        (and then close here)."""
        self.detach(index)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        peer = _Peer(index, ours)
        self.peers[index] = peer
        self.selector.register(ours, selectors.EVENT_READ, peer)
        now = self.clock()
        self.unstored = {jti: exp for jti, exp in self.unstored.items() if exp > now}
        self._send(peer, {"op": "snapshot", "revoked": sorted(self.unstored.items())})
        return theirs

    def detach(self, index: int) -> None:
        """Drop worker `index`'s link (it exited): it is no longer waited for."""
        peer = self.peers.pop(index, None)
        if peer is None:
            return
        self.selector.unregister(peer.sock)
        peer.sock.close()
        for ident, wait in list(self._waits.items()):
            if wait.origin == index:
                del self._waits[ident]  # (nobody to answer)
            else:
                wait.waiting.discard(index)
                self._settle(ident)

    def _drop(self, peer: _Peer) -> None:
        """Detach `peer` if it is still its worker's link (a link replaced by `attach`
        is already closed: its last read must not drop the new one)."""
        if self.peers.get(peer.index) is peer:
            self.detach(peer.index)

    def close(self) -> None:
        for index in list(self.peers):
            self.detach(index)
        self.selector.close()

    # -- the loop ------------------------------------------------------------------------

    def pump(self, timeout: float) -> None:
        """Serve the workers' messages for `timeout` seconds (what the supervisor does
        instead of sleeping)."""
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            wake = min([deadline, *(w.deadline for w in self._waits.values())])
            for key, events in self.selector.select(max(0.0, wake - now)):
                peer: _Peer = key.data
                if events & selectors.EVENT_READ:
                    self._read(peer)
                if events & selectors.EVENT_WRITE and self.peers.get(peer.index) is peer:
                    self._flush(peer)
            self._expire()
            if time.monotonic() >= deadline:
                return

    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(peer)
            return
        try:
            messages = peer.lines.feed(data)
        except ValueError:
            self._drop(peer)
            return
        for message in messages:
            if self.peers.get(peer.index) is not peer:
                return
            try:
                self._handle(peer, message)
            except (KeyError, TypeError, ValueError):
                self.detach(peer.index)  # (a worker of this gateway never sends that)
                return

    def _handle(self, peer: _Peer, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "hello":
            peer.live = True
            self._send(peer, {"op": "welcome"})
        elif op == "revoke":
            jti, exp, ident = str(message["jti"]), float(message["exp"]), int(message["id"])
            self.unstored[jti] = max(exp, self.unstored.get(jti, 0.0))
            wid = next(self._ids)
            others = [i for i in self.peers if i != peer.index]
            live = {i for i in others if self.peers[i].live}
            self._waits[wid] = _Wait(peer.index, ident, live, {peer.index},
                                     time.monotonic() + self.timeout)
            for index in others:
                other = self.peers.get(index)
                if other is not None:
                    self._send(other, {"op": "revoke", "id": wid, "jti": jti, "exp": exp})
            self._settle(wid)
        elif op == "ack":
            wid = int(message["id"])
            wait = self._waits.get(wid)
            if wait is not None:  # (a worker still starting acknowledges too: counted)
                wait.waiting.discard(peer.index)
                wait.held.add(peer.index)
                self._settle(wid)
        elif op == "stored":
            self.unstored.pop(str(message["jti"]), None)
        else:
            raise ValueError(op)

    def _settle(self, wid: int) -> None:
        """Answer the worker that asked once nobody is waited for."""
        wait = self._waits.get(wid)
        if wait is not None and not wait.waiting:
            del self._waits[wid]
            self._done(wait)

    def _expire(self) -> None:
        now = time.monotonic()
        for wid, wait in list(self._waits.items()):
            if wait.deadline <= now:
                del self._waits[wid]
                self._done(wait)

    def _done(self, wait: _Wait) -> None:
        origin = self.peers.get(wait.origin)
        if origin is not None:
            self._send(origin, {"op": "done", "id": wait.ident, "held": sorted(wait.held),
                                "missing": sorted(wait.waiting)})

    def _send(self, peer: _Peer, message: dict[str, Any]) -> None:
        peer.out += encode(message)
        self._flush(peer)

    def _flush(self, peer: _Peer) -> None:
        """Write what the link takes now; the rest when it is writable again."""
        try:
            while peer.out:
                sent = peer.sock.send(peer.out)
                del peer.out[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.detach(peer.index)
            return
        if bool(peer.out) != peer.writing:
            peer.writing = bool(peer.out)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if peer.writing else 0)
            self.selector.modify(peer.sock, events, peer)
