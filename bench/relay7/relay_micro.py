"""Relay cost per small round trip: kernel relay vs recv/send relay, in-process CPU.
Process: relay loop in this process; clients+echo server in a child process (separate core)."""
import asyncio, os, socket, sys, time, resource, multiprocessing
sys.path.insert(0, ".")
from gateway.engines.splice_kernel import KernelRelay, Pipes
sys.path.insert(0, "bench/relay7")
from gateway.engines.relay_native import Relays
import splice_kernel_old as OLD

N, MSG = 10, 200

def echo_clients(port_r, port_echo_q, rounds, ready):
    os.sched_setaffinity(0, {1})
    # echo server
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(64)
    port_echo_q.put(srv.getsockname()[1])
    import threading, selectors
    def serve():
        sel = selectors.DefaultSelector()
        sel.register(srv, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                if key.fileobj is srv:
                    c, _ = srv.accept(); c.setblocking(False); sel.register(c, selectors.EVENT_READ)
                else:
                    try: d = key.fileobj.recv(65536)
                    except BlockingIOError: continue
                    if not d: sel.unregister(key.fileobj); key.fileobj.close(); continue
                    key.fileobj.sendall(d)
    threading.Thread(target=serve, daemon=True).start()
    rport = port_r.get()
    cs = [socket.create_connection(("127.0.0.1", rport)) for _ in range(N)]
    for c in cs: c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ready.set()
    msg = b"x" * MSG
    import selectors
    sel = selectors.DefaultSelector()
    for c in cs: c.setblocking(False); sel.register(c, selectors.EVENT_READ)
    for c in cs: c.send(msg)
    done = 0; total = rounds * N
    while done < total:
        for key, _ in sel.select():
            d = key.fileobj.recv(65536)
            done += 1
            if done + N <= total + N - 1: key.fileobj.send(msg)
    for c in cs: c.close()

import select
class Readiness:
    def __init__(self, loop):
        self.loop = loop; self.ep = select.epoll(); self.h = {}
        loop.add_reader(self.ep.fileno(), self._ready)
    def _set(self, fd, r, w):
        old = self.h.get(fd)
        mask = (select.EPOLLIN if r else 0) | (select.EPOLLOUT if w else 0)
        if not mask:
            if old is not None:
                del self.h[fd]; self.ep.unregister(fd)
            return
        if old is None: self.ep.register(fd, mask)
        else: self.ep.modify(fd, mask)
        self.h[fd] = [r, w]
    def add_reader(self, fd, cb):
        h = self.h.get(fd); self._set(fd, cb, h[1] if h else None)
    def remove_reader(self, fd):
        h = self.h.get(fd); self._set(fd, None, h[1] if h else None)
    def add_writer(self, fd, cb):
        h = self.h.get(fd); self._set(fd, h[0] if h else None, cb)
    def remove_writer(self, fd):
        h = self.h.get(fd); self._set(fd, h[0] if h else None, None)
    def _ready(self):
        get = self.h.get
        for fd, ev in self.ep.poll(0, 64):
            h = get(fd)
            if h is None: continue
            if ev & 0x19 and h[0] is not None: h[0]()   # IN|ERR|HUP
            if ev & 0x1c:  # OUT|ERR|HUP
                h = get(fd)
                if h is not None and h[1] is not None: h[1]()

class UserRelay:
    """recv_into/send relay with add_reader (squid-like)."""
    def __init__(self, a, b, on_done):
        self.loop = asyncio.get_running_loop(); self.a, self.b = a, b
        self.buf = bytearray(65536); self.view = memoryview(self.buf)
    def start(self):
        self.loop.add_reader(self.a.fileno(), self._rd, self.a, self.b)
        self.loop.add_reader(self.b.fileno(), self._rd, self.b, self.a)
    def _rd(self, src, dst):
        try: n = src.recv_into(self.buf)
        except BlockingIOError: return
        if not n:
            self.loop.remove_reader(src.fileno()); self.ended = getattr(self, "ended", 0) + 1
            if self.ended == 1:
                dst.shutdown(socket.SHUT_WR)
            else:
                self.closed = True
            return
        dst.send(self.view[:n])

async def main(kind, port_r, port_echo_q, rounds, ready):
    loop = asyncio.get_running_loop()
    lst = socket.socket(); lst.bind(("127.0.0.1", 0)); lst.listen(64); lst.setblocking(False)
    echo_port = port_echo_q.get()
    port_r.put(lst.getsockname()[1])
    pipes = Pipes(); relays = []; nat = Relays(threaded=(kind == "native")); rd = Readiness(loop) if kind == "nested" else None
    for _ in range(N):
        c, _ = await loop.sock_accept(lst); c.setblocking(False)
        u = socket.socket(); u.setblocking(False); await loop.sock_connect(u, ("127.0.0.1", echo_port))
        for s in (c, u): s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if kind in ("native", "inloop"):
            holder = type("H", (), {})()
            r = nat.relay(c, u, lambda h=holder: setattr(h, "closed", True)); r.start(); relays.append(holder); continue
        r = KernelRelay(c, u, pipes, lambda: None) if kind in ("kernel", "nested") else OLD.KernelRelay(c, u, OLD.Pipes(), lambda: None) if kind == "old" else UserRelay(c, u, lambda: None)
        if rd is not None: r.out.loop = r.into.loop = rd
        r.start(); relays.append(r)
    t0 = resource.getrusage(resource.RUSAGE_SELF)
    w0 = time.monotonic()
    # wait until clients finish: poll for relay end (clients close)
    while True:
        await asyncio.sleep(0.05)
        if all(getattr(r, "closed", False) for r in relays) or time.monotonic() - w0 > 20: break
    t1 = resource.getrusage(resource.RUSAGE_SELF)
    return (t1.ru_utime - t0.ru_utime), (t1.ru_stime - t0.ru_stime), time.monotonic() - w0

if __name__ == "__main__":
    kind = sys.argv[1]; rounds = int(sys.argv[2])
    os.sched_setaffinity(0, {0})
    q1, q2 = multiprocessing.Queue(), multiprocessing.Queue(); ev = multiprocessing.Event()
    p = multiprocessing.Process(target=echo_clients, args=(q1, q2, rounds, ev)); p.start()
    u, s, w = asyncio.run(main(kind, q1, q2, rounds, ev))
    p.join()
    n = rounds * N
    print(f"{kind}: user {u/n*1e6:.2f} us sys {s/n*1e6:.2f} us total {(u+s)/n*1e6:.2f} us per round trip, {n/w:.0f}/s")
