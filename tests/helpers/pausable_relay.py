"""A TCP relay on 127.0.0.1 in front of one server that can stop forwarding (`pause`):
what either side sends meanwhile waits in the relay's sockets, as behind a stalled link,
and flows again on `resume`. One client's connections stall while the server answers
everyone else (redis-server's SIGSTOP or `CLIENT PAUSE` stalls every client)."""

from __future__ import annotations

import contextlib
import select
import socket
import threading

__all__ = ["PausableRelay"]


class PausableRelay:
    """Listens on `port`; each connection is relayed to `target` by one thread."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._open = threading.Event()
        self._open.set()
        self._closed = False
        self._threads = [threading.Thread(target=self._accept, daemon=True,
                                          name="pausable-relay")]
        self._threads[0].start()

    def pause(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closed = True
        self._open.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            thread = threading.Thread(target=self._pump, args=(client, server), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        with a, b:
            while not self._closed:
                self._open.wait()
                ready, _, _ = select.select([a, b], [], [], 0.05)
                if not self._open.is_set():
                    continue  # (paused while waiting: what came stays in the socket)
                for source in ready:
                    try:
                        data = source.recv(65536)
                    except OSError:
                        return
                    if not data:
                        return
                    (b if source is a else a).sendall(data)
