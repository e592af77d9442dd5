"""Side-by-side benchmark: prefix-epp against the routers users would pick instead (`make bench`).

`--repeat N` runs the whole matrix N times, repetition-major (repetition 1: every workload x
router, then repetition 2, ...), on the SAME seeded workloads, so machine drift hits every router
alike and the spread measures the machine's noise. `--vary-seed` draws the workloads anew for
each repetition instead (seeds `--seed`, `--seed` + 1, ...): a router whose choices follow the
arrival order alone (sglang-router, round-robin) repeats one draw's luck exactly, so comparing
such a router on one draw measures that draw; the oracle is then pooled over the draws. For every
workload (`bench.workloads`) and router (`bench.routers`; default DEFAULT_ROUTERS), in that order:
1. start fresh simulated replicas (cold caches; `--replicas`, real time unless `--time-scale`),
   with the workload's KV-cache size (`bench.workloads.kv_cache_blocks` from the oracle's
   working set), and for `clairvoyant` the simulator's clairvoyant front;
2. start the router in front of them and wait until a one-token request gets through;
3. replay the workload open loop (`bench.client`), the same seeded sequence for every router;
4. read prefix-epp's /metrics (decision latency), stop everything, summarise (`bench.metrics`).
The oracle bound (`bench.oracle`) is computed once per workload and draw. `bench.aggregate` folds the
repetitions into mean and min-max per (workload, router); the targets are checked on the means.

Writes to --out-dir (bench/results): {name}.json (config, oracle, the means as `results`, their
`spread`, every repetition's summaries, targets), {name}.md (the tables, `bench.tables`),
{name}-ttft.png, {name}-ttft_p99.png, {name}-hit_rate.png, {name}-load.png, and per-request
records under raw/ (not committed). `name` is "bench", or "bench-quick" with --quick. After
every run {name}-r{k} holds repetition k so far, after every repetition {name} holds all so far,
so a long run that dies keeps what it measured. Each summary also carries `cpu_busy` (the
machine's CPU use during the run) and `start_lag_p99_ms` (how late the client sent against the
plan): both flag a machine too busy to trust the figures. The run prints its estimated length.

    python -m bench.run --repeat 3            # `make bench`: 7 workloads x 7 routers x 3 = 147 runs, ~2 h on 2 cores
    python -m bench.run --quick               # a third of the requests, one repetition, ~20 min
    python -m bench.run --render-only         # rewrite tables and figures from the saved results
    python -m bench.run --workloads hot-prefix --routers prefix-epp least-request
    python -m bench.run --workloads mixed-length bursts --routers prefix-epp prefix-epp-weighted clairvoyant
    python -m bench.run --workloads hot-prefix --routers prefix-epp \\
        --picker-variant "--spill-absolute 2"  # also run prefix-epp with other flags
    python -m bench.run --workloads cache-pressure shared-prefix --routers prefix-epp prefix-epp-precise \\
        --closed-loop --name bench-precise     # precise vs approximate (KV events, closed-loop accuracy)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import client, plots
from bench.aggregate import aggregate
from bench.metrics import Target, evaluate_targets, summarize
from bench.oracle import OracleResult, pooled_oracle, workload_oracle
from bench.peers.go_epp import build_info as go_epp_build_info
from bench.routers import KV_EVENT_ROUTERS, ROUTERS, SimSettings, dead, go_epp_available, sim_replicas, start
from bench.tables import accuracy_table, clairvoyant_table, fmt, results_table, targets_table
from bench.workloads import WORKLOADS, Workload, build, kv_cache_blocks

DEFAULT_REPLICAS = 4
# `make bench`: go-epp and prefix-epp-precise run when named (--routers), not by default.
DEFAULT_ROUTERS = ("random", "round-robin", "least-request", "prefix-epp", "prefix-epp-weighted", "sglang-router",
                   "clairvoyant")
RUN_OVERHEAD_S = 8.0  # per run, on top of the planned load: start the setup, probe, drain, stop, write (2 cores)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ROUTER_PARTS = {"random": "Envoy, lb_policy RANDOM", "round-robin": "Envoy, lb_policy ROUND_ROBIN",
                "least-request": "Envoy, lb_policy LEAST_REQUEST", "prefix-epp": "Envoy + the picker",
                "prefix-epp-weighted": "Envoy + the picker, --scheduler weighted",
                "prefix-epp-precise": "Envoy + the picker, --prefix-scorer precise",
                "go-epp": "Envoy + the Go endpoint picker (GIE v1.5.0, defaults; real kube-apiserver)",
                "sglang-router": "sglang-router cache_aware",
                "clairvoyant": "the simulator's clairvoyant front (true caches and queues; a reference)"}


# --closed-loop: the picker reads every response's usage (cached tokens) instead of the default
# sample, so the table gets both scorers' prediction accuracy on every request.
CLOSED_LOOP_ARGS = ("--usage-sample-rate", "1")


@dataclass(frozen=True)
class RouterSpec:
    """A router setup to run: `name` from bench.routers.ROUTERS; picker flags for prefix-epp variants."""

    name: str
    picker_args: tuple[str, ...] = ()
    closed_loop: bool = False  # sample every response's usage: the closed-loop accuracy of every request

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
            log: Callable[[str], None] | None = None) -> Outcome:
    """Fresh replicas + one router, the whole workload through it, then everything stopped.

    `log` gets one line per phase (the demo shows them).
    """
    say = log or (lambda line: None)
    tmp.mkdir(parents=True, exist_ok=True)
    # Only the picker can use KV events; only the clairvoyant setup needs the simulator's front.
    sim = replace(sim, kv_events=router.name in KV_EVENT_ROUTERS, clairvoyant=router.name == "clairvoyant")
    say(f"[{router.label}] starting {sim.replicas} simulated replicas ({sim.kv_cache_blocks} KV blocks each)")
    with sim_replicas(tmp, sim) as pool:
        say(f"[{router.label}] starting the router ({ROUTER_PARTS.get(router.name, router.name)})")
        with start(router.name, tmp, pool.addresses, router.all_picker_args, pool.kv_events, pool.front) as handle:
            asyncio.run(client.probe(handle.url))
            say(f"[{router.label}] sending {workload.requests} requests over ~{workload.duration_s:.0f} s")
            busy0, total0 = _cpu_busy()
            pids = [p.pid for p in handle.procs]
            cpu0 = process_cpu_s(pids)
            result = asyncio.run(client.run(handle.url, workload, sim.time_scale))
            cpu1 = process_cpu_s(pids)
            busy1, total1 = _cpu_busy()
            died = dead([pool.proc, *handle.procs])
            if died:
                raise SetupDied("; ".join(died))
            picker_metrics = None
            if handle.picker_metrics_url:
                with urllib.request.urlopen(handle.picker_metrics_url, timeout=5) as resp:
                    picker_metrics = resp.read()
    say(f"[{router.label}] {len(result.requests)} requests done in {result.wall_s:.0f} s; everything stopped")
    summary = summarize(result.requests, result.wall_s, pool.addresses, picker_metrics)
    summary["cpu_busy"] = round((busy1 - busy0) / (total1 - total0), 3) if total1 > total0 else None
    # The router's own processes (picker + Envoy, or the router), not the replicas or the API server.
    summary["router_cpu_s"] = round(cpu1 - cpu0, 2)
    summary["router_cpu_ms_per_request"] = round((cpu1 - cpu0) * 1000 / max(1, len(result.requests)), 3)
    return Outcome(summary, result)


def run_retrying(tmp: Path, workload: Workload, router: RouterSpec, sim: SimSettings,
                 log: Callable[[str], None], attempts: int = 2) -> Outcome:
    """`run_one`, again from scratch if a process of the setup died under it (reported in the log)."""
    for attempt in range(1, attempts + 1):
        try:
            return run_one(tmp / f"try{attempt}", workload, router, sim)
        except SetupDied as exc:
            log(f"  {router.label}: {exc} (attempt {attempt} of {attempts}; logs in {tmp})")
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


Summaries = dict[str, dict[str, dict[str, Any]]]  # [workload][router] -> summarize() row


def candidates_of(routers: Sequence[str]) -> list[str]:
    """The setups the goals are checked for: prefix-epp and its variants (not the peers or references)."""
    return [r for r in routers if r.startswith("prefix-epp")]


def write_results(out_dir: Path, name: str, config: dict[str, Any], oracle: dict[str, OracleResult],
                  repetitions: Sequence[Summaries], ttfts: dict[str, dict[str, list[float]]],
                  candidates: Sequence[str]) -> dict[str, list[Target]]:
    """{name}.json, {name}.md and the figures from every repetition's summaries (targets on the means)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rates = {w: o.hit_rate for w, o in oracle.items()}
    means, spreads = aggregate(repetitions)
    shown = spreads if len(repetitions) > 1 else None
    targets = {c: evaluate_targets(means, rates, c) for c in candidates}
    doc = {
        "config": config,
        "oracle": {w: {**asdict(o), "hit_rate": round(o.hit_rate, 4)} for w, o in oracle.items()},
        "results": means,
        "spread": {w: {r: {k: list(v) for k, v in s.items()} for r, s in rows.items()} for w, rows in spreads.items()},
        "repetitions": list(repetitions),
        "targets": {c: [{**asdict(t), "miss": t.miss} for t in ts] for c, ts in targets.items()},
    }
    (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    reps = f"mean (min-max) of {len(repetitions)} repetitions; " if len(repetitions) > 1 else ""
    md = [f"Replicas: {config['replicas']} simulated vLLM replicas (time scale {config['time_scale']}); "
          f"{reps}times in ms of model time; hit rate = cached / prompt tokens from the replicas' usage; "
          "load = requests on the busiest replica / mean; router CPU = user+system CPU of the router's "
          "processes (picker and Envoy) per request.", ""]
    md += [f"Not run: {router}: {why}." for router, why in config.get("not_run", {}).items()]
    md += ["", results_table(means, rates, shown), "", "Targets (on the means):", "", targets_table(targets), ""]
    relative = clairvoyant_table(means)
    if relative:
        md += ["Relative to the clairvoyant reference (routes on the replicas' true caches and queues):", "",
               relative, ""]
    accuracy = accuracy_table(means)
    if accuracy:
        md += ["Closed-loop prediction of cached tokens (picker /metrics at the end of each run; the router "
               "routes with its own scorer, the other one's prediction is recorded alongside):", "", accuracy, ""]
    (out_dir / f"{name}.md").write_text("\n".join(md))
    if means:
        plots.write_all(means, rates, ttfts, out_dir, name, shown)
    return targets


def estimate_s(workloads: Sequence[Workload], routers: int, repeat: int) -> float:
    """Expected wall time: every run's planned load plus RUN_OVERHEAD_S (start, drain, stop)."""
    return repeat * routers * sum(w.duration_s + RUN_OVERHEAD_S for w in workloads)


@dataclass(frozen=True)
class Draw:
    """The workloads drawn with one seed, their infinite-cache oracles and replica settings."""

    workloads: dict[str, Workload]
    oracle: dict[str, OracleResult]
    sims: dict[str, SimSettings]

    @classmethod
    def of(cls, names: Sequence[str], seed: int, *, quick: bool, load: float, replicas: int,
           time_scale: float) -> Draw:
        workloads = {w: build(w, quick=quick, seed=seed, load=load) for w in names}
        oracle = {w: workload_oracle(wl) for w, wl in workloads.items()}
        sims = {w: sim_settings(oracle[w], replicas, time_scale, wl) for w, wl in workloads.items()}
        return cls(workloads, oracle, sims)


def run_all(workloads: Sequence[str], routers: Sequence[RouterSpec], *, quick: bool, replicas: int, load: float,
            time_scale: float, out_dir: Path, name: str, log: Callable[[str], None] = print,
            work_dir: Path | None = None, repeat: int = 1, seed: int = 0, vary_seed: bool = False) -> dict[str, Any]:
    """The matrix `repeat` times, repetition-major, on the same seeded workloads (`seed`), or with
    `vary_seed` on a new draw of them per repetition (seed, seed + 1, ...).

    After every run: {name}-r{k} (repetition k so far); after every repetition: {name} (all so far).
    """
    config: dict[str, Any] = {"replicas": replicas, "time_scale": time_scale, "quick": quick, "load": load,
                              "repeat": repeat, "seed": seed, "vary_seed": vary_seed,
                              "closed_loop": any(r.closed_loop for r in routers), "workloads": {}}
    if any(r.name == "go-epp" for r in routers):
        why = go_epp_available()
        if why:  # `make bench` on a machine without Go: the table says go-epp was not run, and why
            config["not_run"] = {"go-epp": why}
            routers = [r for r in routers if r.name != "go-epp"]
            log(f"go-epp not run: {why}")
        else:
            config["go_epp_build"] = go_epp_build_info()
    candidates = candidates_of([r.label for r in routers])
    seeds = [seed + k for k in range(repeat)] if vary_seed else [seed] * repeat
    draws = {s: Draw.of(workloads, s, quick=quick, load=load, replicas=replicas, time_scale=time_scale)
             for s in dict.fromkeys(seeds)}
    first = draws[seed]
    oracle = pooled_oracle([d.oracle for d in draws.values()])
    for wname, workload in first.workloads.items():
        sim = first.sims[wname]
        config["workloads"][wname] = {"params": dict(workload.params), "requests": workload.requests,
                                      "kv_cache_blocks_per_replica": sim.kv_cache_blocks}
        log(f"{wname}: {workload.requests} requests over ~{workload.duration_s:.0f} s, oracle hit rate "
            f"{oracle[wname].hit_rate:.1%}, prefix working set {first.oracle[wname].working_set_blocks} blocks, "
            f"KV cache {sim.kv_cache_blocks} blocks x {replicas} replicas"
            + (f" (seed {seed}; seeds {seeds[0]}-{seeds[-1]}, one per repetition)" if vary_seed else ""))
    log(f"{repeat} x {len(workloads)} workloads x {len(routers)} routers = {repeat * len(workloads) * len(routers)} "
        f"runs, estimated {estimate_s(list(first.workloads.values()), len(routers), repeat) / 60:.0f} min")
    raw_dir = out_dir / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    repetitions: list[Summaries] = []
    ttfts: dict[str, dict[str, list[float]]] = {}
    total, done, began = repeat * len(workloads) * len(routers), 0, time.monotonic()
    with tempfile.TemporaryDirectory(prefix="prefix-epp-bench-") as tmp_dir:
        tmp_root = str(work_dir) if work_dir else tmp_dir
        for k in range(1, repeat + 1):
            rep: Summaries = {}
            rep_ttfts: dict[str, dict[str, list[float]]] = {}
            rep_name = f"{name}-r{k}"
            built, sims = draws[seeds[k - 1]].workloads, draws[seeds[k - 1]].sims
            for wname, workload in built.items():
                for router in routers:
                    done += 1
                    t0 = time.monotonic()
                    outcome = run_retrying(Path(tmp_root) / f"{wname}-{done}", workload, router, sims[wname], log)
                    s = outcome.summary
                    rep.setdefault(wname, {})[router.label] = s
                    samples = [r.ttft_s * 1000 for r in outcome.run.requests if r.ok and r.ttft_s is not None]
                    rep_ttfts.setdefault(wname, {})[router.label] = samples
                    ttfts.setdefault(wname, {}).setdefault(router.label, []).extend(samples)
                    (raw_dir / f"{rep_name}.{wname}.{router.label.replace(' ', '_')}.json").write_text(
                        json.dumps([asdict(r) for r in outcome.run.requests]))
                    log(f"  [{done}/{total}] r{k} {wname} {router.label:<14} hit {s['hit_rate']:.1%}  "
                        f"TTFT p50 {fmt(s['ttft_ms']['p50'])} p99 {fmt(s['ttft_ms']['p99'])} ms  "
                        f"max/mean load {s['replica_max_over_mean']:.2f}  errors {s['errors']}  "
                        f"cpu {s['cpu_busy']:.0%}  ({time.monotonic() - t0:.0f} s)")
                    write_results(out_dir, rep_name, {**config, "raw_names": [rep_name]}, oracle, [rep], rep_ttfts,
                                  candidates)
            repetitions.append(rep)
            config["raw_names"] = [f"{name}-r{i}" for i in range(1, k + 1)]
            targets = write_results(out_dir, name, config, oracle, repetitions, ttfts, candidates)
    log(f"done in {time.monotonic() - began:.0f} s; results in {out_dir}/{name}.md")
    means, _ = aggregate(repetitions)
    return {"summaries": means, "repetitions": repetitions, "oracle": oracle, "targets": targets}


def render_only(out_dir: Path, name: str) -> None:
    """Rewrite {name}.md and the figures from {name}.json and raw/ (after changing the tables or plots)."""
    doc = json.loads((out_dir / f"{name}.json").read_text())
    oracle = {w: OracleResult(o["prompt_tokens"], o["cached_tokens"], o["working_set_blocks"],
                              o["largest_request_blocks"]) for w, o in doc["oracle"].items()}
    repetitions = doc.get("repetitions") or [doc["results"]]  # results files from before repetitions
    raw_names = doc["config"].get("raw_names", [name])
    ttfts: dict[str, dict[str, list[float]]] = {}
    for raw_name, summaries in zip(raw_names, repetitions, strict=False):
        for workload, rows in summaries.items():
            for router in rows:
                path = out_dir / "raw" / f"{raw_name}.{workload}.{router.replace(' ', '_')}.json"
                raw = json.loads(path.read_text()) if path.exists() else []
                ttfts.setdefault(workload, {}).setdefault(router, []).extend(
                    r["ttft_s"] * 1000 for r in raw if r["status"] == 200 and not r["error"] and r["ttft_s"])
    write_results(out_dir, name, doc["config"], oracle, repetitions, ttfts, list(doc["targets"]))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="about a third of the requests per workload")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(DEFAULT_ROUTERS),
                   help=f"default: {' '.join(DEFAULT_ROUTERS)}")
    p.add_argument("--picker-variant", action="append", default=[], metavar="FLAGS",
                   help="also run prefix-epp with these extra flags, e.g. '--spill-absolute 2' (repeatable)")
    p.add_argument("--closed-loop", action="store_true",
                   help="prefix-epp setups read every response's usage (--usage-sample-rate 1): prediction "
                        "accuracy on every request, at a picker round trip per streamed chunk")
    p.add_argument("--repeat", type=int, default=1, help="run the whole matrix this many times (same workloads)")
    p.add_argument("--replicas", type=int, default=DEFAULT_REPLICAS)
    p.add_argument("--seed", type=int, default=0,
                   help="workload seed: another draw of the same workloads (prompts, order, arrival times)")
    p.add_argument("--vary-seed", action="store_true",
                   help="repetition k runs the workloads drawn with seed + k - 1 (workload variance, not only noise)")
    p.add_argument("--load", type=float, default=1.0, help="multiply every arrival rate (calibration)")
    p.add_argument("--time-scale", type=float, default=1.0, help="simulator speed-up (1: real time)")
    p.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    p.add_argument("--name", help="file name stem (default: bench, or bench-quick with --quick)")
    p.add_argument("--work-dir", type=Path, help="keep configs and process logs here (default: a temporary dir)")
    p.add_argument("--render-only", action="store_true", help="rewrite the tables and figures from saved results")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    routers = [RouterSpec(r, closed_loop=args.closed_loop) for r in args.routers]
    routers += [RouterSpec("prefix-epp", tuple(shlex.split(v)), args.closed_loop) for v in args.picker_variant]
    name = args.name or ("bench-quick" if args.quick else "bench")
    if args.render_only:
        render_only(args.out_dir, name)
        print((args.out_dir / f"{name}.md").read_text())
        return 0
    result = run_all(args.workloads, routers, quick=args.quick, replicas=args.replicas, load=args.load,
                     time_scale=args.time_scale, out_dir=args.out_dir, name=name,
                     log=lambda line: print(line, flush=True), work_dir=args.work_dir, repeat=args.repeat,
                     seed=args.seed, vary_seed=args.vary_seed)
    print((args.out_dir / f"{name}.md").read_text())
    return 0 if result["summaries"] else 1


if __name__ == "__main__":
    sys.exit(main())
