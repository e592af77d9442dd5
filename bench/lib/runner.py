"""One benchmark run: fresh simulated replicas, one router in front of them, one workload through it.

`run_one(tmp, workload, router, sim)`:
1. start `sim.replicas` fresh simulated replicas (cold caches; `bench.lib.routers.sim_replicas`),
   publishing KV events only for the routers that can use them (`KV_EVENT_ROUTERS`), and with the
   simulator's clairvoyant front for `clairvoyant`;
2. start the router (`bench.lib.routers.start`) and wait until a one-token request gets through;
3. replay the workload open loop (`bench.lib.client`) at `sim.time_scale`;
4. read prefix-epp's /metrics (decision latency, closed-loop accuracy), stop everything, and
   summarise (`bench.lib.stats.summarize`), adding `cpu_busy` (the machine's CPU use during the
   run) and the router's own CPU (`router_cpu_s`, `router_cpu_ms_per_request`: picker + Envoy,
   or the router process; not the replicas or the API server), and, for the setups that run
   Envoy, `gateway_ms`: Envoy's time from a request's first byte to its upstream request, from
   the access log (`bench.lib.stats.gateway_figures`).
With `RouterSpec.realtime` (`--routers-realtime`) the router's processes run SCHED_FIFO
(`realtime`): the engines' busy cores then delay no router wakeup.
A process of the setup that dies during the run raises `SetupDied`; `run_retrying` then starts
over from scratch (`attempts`, 2). `sim_settings` sizes the replicas' KV cache from the oracle's
working set (`bench.lib.workloads.kv_cache_blocks`). `RouterSpec` names a setup of
`bench.lib.routers.ROUTERS`, with extra picker flags for prefix-epp variants.

With `backend` (real vLLM, `bench.lib.vllm_backend`) step 1 is instead: wait until the engines
started for the whole matrix are idle and reset their prefix caches; the prefix-epp setups get
the model's tokenizer (`VllmBackend.picker_args`), and the summary adds the engines' own figures
between the probe and the end of the load (`engine_hit_rate`, `engine_requests`,
`engine_ttft_ms_mean`, `engine_queue_ms_mean`), the requests as the load-balance columns when
no response named its replica (`bench.lib.stats.with_engine_load`).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.lib import client
from bench.lib.oracle import OracleResult
from bench.lib.routers import KV_EVENT_ROUTERS, PUBLISHING_ROUTERS, SimSettings, dead, sim_replicas, start
from bench.lib.stats import gateway_figures, summarize, with_engine_load
from bench.lib.vllm_backend import VllmBackend
from bench.lib.workloads import Workload, kv_cache_blocks
from testkit.procs import Proc

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ROUTER_PARTS = {"random": "Envoy, lb_policy RANDOM", "round-robin": "Envoy, lb_policy ROUND_ROBIN",
                "least-request": "Envoy, lb_policy LEAST_REQUEST", "prefix-epp": "Envoy + the picker",
                "prefix-epp-weighted": "Envoy + the picker, --scheduler weighted",
                "prefix-epp-cache-aware": "Envoy + the picker, --scheduler cache-aware",
                "prefix-epp-precise": "Envoy + the picker, --prefix-scorer precise",
                "go-epp": "Envoy + the Go endpoint picker (GIE v1.5.0, defaults; real kube-apiserver)",
                "llm-d": "Envoy + llm-d's router (default profile; real kube-apiserver)",
                "llm-d-precise": "Envoy + llm-d's router (precise prefix + token load, KV events; kube-apiserver)",
                "sglang-router": "sglang-router cache_aware",
                "clairvoyant": "the simulator's clairvoyant front (true caches and queues; a reference)"}


# --closed-loop: the picker reads every response's usage (cached tokens) instead of the default
# sample, so the table gets both scorers' prediction accuracy on every request.
CLOSED_LOOP_ARGS = ("--usage-sample-rate", "1")


@dataclass(frozen=True)
class RouterSpec:
    """A router setup to run: `name` from bench.lib.routers.ROUTERS; picker flags for prefix-epp variants."""

    name: str
    picker_args: tuple[str, ...] = ()
    closed_loop: bool = False  # sample every response's usage: the closed-loop accuracy of every request
    realtime: bool = False  # the router's processes run SCHED_FIFO (`realtime`): never waiting for a core

    @property
    def label(self) -> str:
        return f"{self.name} {shlex.join(self.picker_args)}" if self.picker_args else self.name

    @property
    def all_picker_args(self) -> tuple[str, ...]:
        return (*CLOSED_LOOP_ARGS, *self.picker_args) if self.closed_loop else self.picker_args


@dataclass
class Outcome:
    summary: dict[str, Any]
    run: client.RunResult


def sim_settings(oracle: OracleResult, replicas: int, time_scale: float,
                 workload: Workload | None = None) -> SimSettings:
    sizing = (workload.pool_factor, workload.running_headroom) if workload else ()
    blocks = kv_cache_blocks(oracle.working_set_blocks, oracle.largest_request_blocks, replicas, *sizing)
    return SimSettings(replicas=replicas, kv_cache_blocks=blocks, time_scale=time_scale)


REALTIME = ("chrt", "--all-tasks", "--fifo", "--pid", "10")


def realtime(procs: Sequence[Proc]) -> None:
    """Every thread of each process to SCHED_FIFO priority 10 (threads it starts later inherit it).

    On a machine whose cores the engines keep busy, a router process that sleeps between requests
    waits for a core at every wakeup (tens to hundreds of ms when both cores are taken), and a
    setup of two processes (Envoy and a picker) wakes more often per request than one proxy. A
    router deployed beside GPU engines has CPU to itself; this puts every setup there alike.
    """
    for proc in procs:
        subprocess.run([*REALTIME, str(proc.pid)], check=True, capture_output=True)


def _last_lines(path: Path | None, n: int) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text().splitlines()[-n:])


def _cpu_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


def process_cpu_s(pids: Sequence[int]) -> float:
    """User + system CPU seconds used so far by these processes (their threads included), from /proc."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
    return total


class SetupDied(RuntimeError):
    """A process of the setup (replicas, Envoy, picker, router) stopped during the run."""


def run_one(tmp: Path, workload: Workload, router: RouterSpec, sim: SimSettings,
            log: Callable[[str], None] | None = None, backend: VllmBackend | None = None) -> Outcome:
    """Fresh replicas (or `backend`'s reset engines) + one router, the whole workload through it,
    then everything stopped.

    `log` gets one line per phase (the demo shows them).
    """
    say = log or (lambda line: None)
    tmp.mkdir(parents=True, exist_ok=True)
    # Only the picker can use KV events; only the clairvoyant setup needs the simulator's front.
    sim = replace(sim, kv_events=router.name in PUBLISHING_ROUTERS, clairvoyant=router.name == "clairvoyant")
    picker_args = router.all_picker_args
    if backend is None:
        say(f"[{router.label}] starting {sim.replicas} simulated replicas ({sim.kv_cache_blocks} KV blocks each)")
        replicas = sim_replicas(tmp, sim)
        if router.name in KV_EVENT_ROUTERS:
            picker_args = (*sim.picker_args, *picker_args)
    else:
        say(f"[{router.label}] resetting the prefix caches of {len(backend.engines)} idle vLLM engines")
        replicas = backend.pool()
        if router.name in KV_EVENT_ROUTERS:
            picker_args = (*backend.picker_args, *picker_args)
    engine: dict[str, Any] = {}
    with replicas as pool:
        say(f"[{router.label}] starting the router ({ROUTER_PARTS.get(router.name, router.name)})")
        with start(router.name, tmp, pool.addresses, picker_args, pool.kv_events, pool.front) as handle:
            if router.realtime:
                realtime(handle.procs)
            asyncio.run(client.probe(handle.url, sampling=dict(workload.sessions[0].sampling)))
            say(f"[{router.label}] sending {workload.requests} requests over ~{workload.duration_s:.0f} s")
            mark = backend.mark() if backend else []
            busy0, total0 = _cpu_busy()
            pids = [p.pid for p in handle.procs]
            cpu0 = process_cpu_s(pids)
            result = asyncio.run(client.run(handle.url, workload, sim.time_scale))
            cpu1 = process_cpu_s(pids)
            busy1, total1 = _cpu_busy()
            if backend:
                engine = backend.figures(mark)
            died = dead([*pool.procs, *handle.procs])
            if died:
                raise SetupDied("; ".join(died))
            picker_metrics = None
            if handle.picker_metrics_url:
                with urllib.request.urlopen(handle.picker_metrics_url, timeout=5) as resp:
                    picker_metrics = resp.read()
    say(f"[{router.label}] {len(result.requests)} requests done in {result.wall_s:.0f} s; everything stopped")
    summary = summarize(result.requests, result.wall_s, pool.addresses, picker_metrics)
    # The log's last lines are the workload's requests (the probe's comes first); Envoy has
    # flushed it by now, having stopped.
    gateway = gateway_figures(_last_lines(handle.access_log, len(result.requests)))
    if gateway:
        summary["gateway_ms"] = gateway
    if engine:
        summary = with_engine_load(summary, **engine)
    summary["cpu_busy"] = round((busy1 - busy0) / (total1 - total0), 3) if total1 > total0 else None
    # The router's own processes (picker + Envoy, or the router), not the replicas or the API server.
    summary["router_cpu_s"] = round(cpu1 - cpu0, 2)
    summary["router_cpu_ms_per_request"] = round((cpu1 - cpu0) * 1000 / max(1, len(result.requests)), 3)
    return Outcome(summary, result)


def run_retrying(tmp: Path, workload: Workload, router: RouterSpec, sim: SimSettings,
                 log: Callable[[str], None], attempts: int = 2, backend: VllmBackend | None = None) -> Outcome:
    """`run_one`, again from scratch if a process of the setup died under it (reported in the log)."""
    for attempt in range(1, attempts + 1):
        try:
            return run_one(tmp / f"try{attempt}", workload, router, sim, backend=backend)
        except SetupDied as exc:
            log(f"  {router.label}: {exc} (attempt {attempt} of {attempts}; logs in {tmp})")
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")
