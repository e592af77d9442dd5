"""`--workers N`: N picker processes in one pod, one core each, routing as one.

Supervisor (the process `prefix-epp serve` started, PID 1 in a container):
- picks N free loopback ports for the workers' sibling sync links, makes a random shared secret
  when none was configured (siblings must authenticate too), and starts N copies of the same
  command with env PREFIX_EPP_WORKER="<index>/<count>/<port>,<port>,..."; `worker_role()` reads it;
- forwards SIGTERM/SIGINT to every worker (each drains on its own, extproc/transport/streams.py) and exits
  when all have exited; a worker that dies while no stop was asked is restarted after
  `restart_delay_s` (1 s).

Each worker (`WorkerRole`):
- binds the ext_proc port with SO_REUSEPORT: the kernel spreads Envoy's connections over workers;
- syncs its index with its siblings and the pod's peers (extproc/sync/manager.py), so every
  worker sees every decision of the pod and of the other pods;
- worker 0 alone serves the health port and /metrics: one endpoint per pod. Its readiness
  is the pod's; its /metrics adds every sibling's samples with a `worker` label
  (extproc/telemetry/pod.py); siblings serve theirs on a loopback port for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from types import FrameType

log = logging.getLogger("prefix_epp.workers")

WORKER_ENV = "PREFIX_EPP_WORKER"
restart_delay_s = 1.0


@dataclass(frozen=True)
class WorkerRole:
    index: int = 0
    count: int = 1
    sibling_port: int = 0  # this worker's loopback sync port (0: single process)
    siblings: tuple[str, ...] = ()  # the other workers' loopback sync addresses
    metrics_port: int = 0  # this worker's loopback /metrics (workers other than 0)
    sibling_metrics: tuple[tuple[int, str], ...] = ()  # worker 0: (index, URL) of the others' /metrics


def worker_role(environ: dict[str, str] | None = None) -> WorkerRole | None:
    """The role the supervisor gave this process, or None (not a worker)."""
    value = (environ if environ is not None else os.environ).get(WORKER_ENV, "")
    if not value:
        return None
    try:
        index_s, count_s, ports_s, metrics_s = value.split("/")
        index, count = int(index_s), int(count_s)
        ports = [int(p) for p in ports_s.split(",")]
        metrics = [int(p) for p in metrics_s.split(",")]
    except ValueError:
        raise ValueError(f"bad {WORKER_ENV}={value!r}") from None
    if not 0 <= index < count == len(ports) == len(metrics):
        raise ValueError(f"bad {WORKER_ENV}={value!r}")
    others = [i for i in range(count) if i != index]
    return WorkerRole(index, count, ports[index], tuple(f"127.0.0.1:{ports[i]}" for i in others),
                      metrics[index] if index else 0,
                      tuple((i, f"http://127.0.0.1:{metrics[i]}/metrics") for i in others) if index == 0 else ())


def _free_loopback_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def supervise(count: int, argv: list[str], secret_env: str, have_secret: bool) -> int:
    """Run `count` workers of `argv` until they all exit; returns 0 when they stopped cleanly."""
    ports = _free_loopback_ports(2 * count)
    sync_ports, metrics_ports = ",".join(map(str, ports[:count])), ",".join(map(str, ports[count:]))
    env = dict(os.environ)
    if not have_secret:
        env[secret_env] = secrets.token_hex(32)
    stopping = False
    procs: list[subprocess.Popen[bytes] | None] = [None] * count

    def spawn(i: int) -> subprocess.Popen[bytes]:
        worker_env = {**env, WORKER_ENV: f"{i}/{count}/{sync_ports}/{metrics_ports}"}
        return subprocess.Popen([sys.executable, "-m", "extproc", *argv], env=worker_env)

    def forward(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    for i in range(count):
        procs[i] = spawn(i)
    log.info("workers started", extra={"workers": count, "pids": [p.pid for p in procs if p]})
    failed = False
    while True:
        alive = 0
        for i, p in enumerate(procs):
            if p is None:
                continue
            rc = p.poll()
            if rc is None:
                alive += 1
            elif not stopping:
                log.warning("worker exited; restarting", extra={"worker": i, "rc": rc})
                time.sleep(restart_delay_s)
                procs[i] = spawn(i)
                alive += 1
            else:
                failed = failed or rc != 0
                procs[i] = None
        if alive == 0:
            return 1 if failed else 0
        time.sleep(0.1)
