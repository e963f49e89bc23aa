"""Worker count: affinity capped by the cgroup v2 CPU quota."""

from pathlib import Path

import pytest

from gateway.runtime.workers import available_cpus


@pytest.mark.parametrize(("cpu_max", "cap"), [
    ("max 100000\n", None), ("200000 100000\n", 2), ("150000 100000\n", 2),
    ("50000 100000\n", 1), ("garbage", None),
])
def test_available_cpus_honours_the_cgroup_quota(tmp_path: Path, cpu_max: str,
                                                 cap: int | None) -> None:
    import os

    path = tmp_path / "cpu.max"
    path.write_text(cpu_max)
    cpus = len(os.sched_getaffinity(0))
    assert available_cpus(path) == (cpus if cap is None else min(cpus, cap))


def test_no_cgroup_file_means_affinity(tmp_path: Path) -> None:
    import os

    assert available_cpus(tmp_path / "missing") == len(os.sched_getaffinity(0))


def test_a_port_reserved_for_workers_is_refused_to_a_second_gateway() -> None:
    """`reserve` holds a port for its workers before they listen: a second supervisor
    reserving it then is refused (with SO_REUSEADDR on the reserved socket it was not,
    and the two gateways' workers shared the port's connections: seen in CI as a token
    asked of one gateway answered 401 by another's admin API); the workers still join
    it, and a restart binds beside its predecessor's connections in TIME_WAIT."""
    import socket
    import time

    from gateway.config import HostPort
    from gateway.runtime.startup import bind
    from gateway.runtime.workers import reserve

    held = reserve("127.0.0.1", 0)
    port = held.getsockname()[1]
    with pytest.raises(OSError, match="is another gateway or program serving it"):
        reserve("127.0.0.1", port)
    worker = bind(HostPort("127.0.0.1", port), shared=True)
    worker.setblocking(True)
    worker.listen()
    clients = []
    for _ in range(3):  # (the server closes first: its side waits in TIME_WAIT)
        clients.append(socket.create_connection(("127.0.0.1", port)))
        worker.accept()[0].close()
    time.sleep(0.1)
    for client in clients:
        client.close()
    worker.close()
    held.close()
    again = reserve("127.0.0.1", port)  # (a restart on the same port)
    bind(HostPort("127.0.0.1", port), shared=True).close()
    again.close()
