import os, sys, tempfile, contextlib, time, glob
from pathlib import Path
sys.path.insert(0, os.getcwd())
from bench.__main__ import Bench, FULL, ROWS, _cores, StaticUpstream, SSEServer, LocalCA
proxy_cpu, client_cpu = _cores()
os.sched_setaffinity(0, {client_cpu})
rows = {r.key: r for r in ROWS}
so = glob.glob("gateway/engines/_relay.cpython-*.so")[0]
def split(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]), int(f[12])
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
secs = float(sys.argv[2]) if len(sys.argv) > 2 else 4
with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
    b = Bench(FULL, Path(tmp), proxy_cpu, client_cpu, set(), ())
    b.ca = LocalCA.create(b.workdir / "ca")
    b.static = StaticUpstream(b.workdir, b.ca, b.sizes.big_bytes, b.client_cpu); stack.callback(b.static.stop); b.static.start()
    b.sse = SSEServer(b.workdir, b.ca); stack.callback(b.sse.stop); b.sse.start()
    res_all = {}
    for r in range(rounds):
        order = ["native", "inloop", "python", "squid"] if r % 2 == 0 else ["squid", "python", "inloop", "native"]
        for kind in order:
            os.environ["SGW_RELAY_MODE"] = kind
            p = b.make_proxy("squid" if kind == "squid" else "gateway", "s" + str(time.monotonic_ns())); p.start()
            u0, s0 = split(p.pid)
            key = "squid" if kind == "squid" else "gateway_passthrough"
            res = b.client({**b.spec(rows[key], "get_c10", p), "duration": secs}, p, 80)
            u1, s1 = split(p.pid)
            ok = res["ok"]; tck = os.sysconf("SC_CLK_TCK")
            u, s = (u1-u0)/tck/ok*1e6, (s1-s0)/tck/ok*1e6
            res_all.setdefault(kind, []).append(u + s)
            print(f"{kind:7s} user {u:5.1f} sys {s:5.1f} total {u+s:5.1f} us/req {ok/secs:6.0f} req/s proxyCPU {res['proxy_cpu_s']/ok*1e6:5.1f}", flush=True)
            p.stop()
    for k, v in res_all.items():
        print(k, " ".join(f"{x:.1f}" for x in v))
