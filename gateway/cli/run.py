"""`run`: start the gateway (one process, or a supervisor and its workers)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from gateway import __version__
from gateway.cli.common import config_of
from gateway.config import ENV_PREFIX, Config, reach
from gateway.net import ca


def cmd_run(args: argparse.Namespace) -> int:
    if args.learn:  # (the environment reaches the workers too)
        os.environ[ENV_PREFIX + "LEARN"] = "true"
    cfg = config_of(args)
    from gateway.observability.logs import configure

    configure(cfg.log_level)  # every handler redacts secrets and tokens (observability/logs.py)
    if args.worker_index is None:  # once, not per worker
        from gateway.tools.config_check import config_warnings

        for warning in config_warnings(cfg):
            logging.getLogger("sandbox_gateway").warning("%s", warning)
    workers = args.workers if args.workers is not None else cfg.workers
    if workers == 0:
        from gateway.runtime.workers import available_cpus

        workers = available_cpus()
    if args.worker_index is None and workers > 1:
        from gateway.runtime.workers import run_supervisor

        return run_supervisor(cfg, getattr(args, "config", None), workers)
    if args.supervisor is not None:
        from gateway.runtime.workers import follow_supervisor

        follow_supervisor(args.supervisor)
    return _run_single(cfg, args.worker_index, args.relay_fd)


def _run_single(cfg: Config, worker: int | None, relay_fd: int | None = None) -> int:
    """One gateway process (alone, or worker `worker` of a supervisor, whose revocation
    relay is on descriptor `relay_fd`)."""
    from gateway.engines.patches import lean_dependencies

    lean_dependencies()  # (a no-op for what `__main__` registered bare already)
    from gateway.net.resolver import new_event_loop
    from gateway.runtime.app import Gateway, StartupError

    async def main() -> int:
        gateway = Gateway(cfg, worker=worker, relay_fd=relay_fd)
        try:
            await gateway.start()
        except StartupError as exc:
            print(f"sandbox-gateway: {exc}", file=sys.stderr)
            return 2
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if worker is None:
            _banner(gateway)
        else:
            assert cfg.runtime_dir is not None
            (cfg.runtime_dir / f"ready-{worker}").touch()
        await stop.wait()
        if worker is None:
            print(f"sandbox-gateway: draining (at most {cfg.shutdown.drain:g}s; a second "
                  "signal stops at once)", file=sys.stderr)
        drain = loop.create_task(gateway.drain())
        stop.clear()
        waiter = loop.create_task(stop.wait())
        await asyncio.wait({drain, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        drain.cancel()
        await gateway.stop()
        return 0

    return asyncio.run(main(), loop_factory=new_event_loop)


def _banner(gateway: object) -> None:
    from gateway.runtime.app import Gateway

    assert isinstance(gateway, Gateway)
    cfg = gateway.config
    assert gateway.proxy_address and gateway.admin_address
    lines = [
        f"sandbox-gateway {__version__} ready",
        f"  proxy   http://{_fmt(gateway.proxy_address)}   (HTTPS_PROXY for sandboxes; "
        f"{reach(gateway.proxy_address[0], cfg.listen.reachable_from)})",
        f"  admin   http://{_fmt(gateway.admin_address)}   (/healthz /readyz /metrics /v1/...)",
        f"  CA      {cfg.certs / ca.CA_CERT}   (sandboxes must trust it)",
        f"  policies {cfg.policies} ({len(gateway.current_policies().policies)} loaded, "
        "hot-reloaded)" + (", all in mode: learn (allowed and recorded, see `policy learn`)"
                           if cfg.learn else ""),
        f"  limits  {gateway.fd_limit} open files -> at most {gateway.gate.max_connections} "
        f"connections, {cfg.limits.connections_per_sandbox} per sandbox",
    ]
    if gateway.dns is not None:
        lines.insert(3, f"  dns     {_fmt(gateway.dns.addresses[0])}   (udp+tcp; registered "
                        "sandboxes only)")
    lines.append(ca.admin_token_line(cfg.certs, bool(cfg.admin_token),
                                        gateway.admin_token_created))
    print("\n".join(lines), file=sys.stderr, flush=True)


def _fmt(addr: tuple[str, int]) -> str:
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser],
             common: argparse.ArgumentParser) -> None:
    """Add the `run` command to the parser."""
    run = sub.add_parser("run", parents=[common], help="start the gateway")
    run.add_argument("--workers", type=int, default=None, metavar="N",
                     help="worker processes sharing the ports (default: config workers; "
                          "0 = one per core)")
    run.add_argument("--learn", action="store_true",
                     help="every policy in mode: learn for this run: allowed, recorded for "
                          "`policy learn` (see docs/policies.md)")
    run.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    run.add_argument("--supervisor", type=int, default=None, help=argparse.SUPPRESS)
    run.add_argument("--relay-fd", type=int, default=None, help=argparse.SUPPRESS)
    run.set_defaults(func=cmd_run)
