import os, sys, tempfile, contextlib, time
from pathlib import Path
sys.path.insert(0, os.getcwd())
from bench.__main__ import Bench, FULL, ROWS, _cores, StaticUpstream, SSEServer, LocalCA
proxy_cpu, client_cpu = _cores()
os.sched_setaffinity(0, {client_cpu})
rows = {r.key: r for r in ROWS}
def tasks(pid):
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        f = open(f"/proc/{pid}/task/{t}/stat").read()
        name = f[f.index("(")+1:f.rindex(")")]
        x = f.rsplit(")", 1)[1].split()
        cs = [l for l in open(f"/proc/{pid}/task/{t}/status") if l.startswith("voluntary_ctxt")][0].split()[1]
        out[t] = (name, int(x[11]), int(x[12]), int(cs))
    return out
with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
    b = Bench(FULL, Path(tmp), proxy_cpu, client_cpu, set(), ())
    b.ca = LocalCA.create(b.workdir / "ca")
    b.static = StaticUpstream(b.workdir, b.ca, b.sizes.big_bytes, b.client_cpu); stack.callback(b.static.stop); b.static.start()
    b.sse = SSEServer(b.workdir, b.ca); stack.callback(b.sse.stop); b.sse.start()
    for kind in sys.argv[1:]:
        os.environ["SGW_RELAY_MODE"] = kind
        p = b.make_proxy("gateway", "s" + str(time.monotonic_ns())); p.start()
        t0 = tasks(p.pid)
        res = b.client({**b.spec(rows["gateway_passthrough"], "get_c10", p), "duration": 4}, p, 80)
        t1 = tasks(p.pid); ok = res["ok"]; tck = os.sysconf("SC_CLK_TCK")
        print(kind, ok, "req")
        for t, (name, u, s, c) in t1.items():
            u0, s0, c0 = t0.get(t, (name, 0, 0, 0))[1:]
            if u - u0 or s - s0:
                print(f"   {name:20s} user {(u-u0)/tck/ok*1e6:5.1f} sys {(s-s0)/tck/ok*1e6:5.1f} us/req  switches/req {(c-c0)/ok:.2f}")
        p.stop()
