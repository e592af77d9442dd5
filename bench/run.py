"""Side-by-side benchmark: prefix-epp against the routers users would pick instead (`make bench`).

Order. `--repeat N` runs the whole matrix N times, repetition-major (repetition 1: every workload
x router, then repetition 2, ...), on the SAME seeded workloads, so machine drift hits every
router alike and the spread measures the machine's noise. `--vary-seed` draws the workloads anew
for each repetition instead (seeds `--seed`, `--seed` + 1, ...): a router whose choices follow
the arrival order alone (sglang-router, round-robin) repeats one draw's luck exactly, so comparing
such a router on one draw measures that draw; the oracle is then pooled over the draws. Within a
repetition, workload by workload, the routers (the arms) run one after another, interleaved
(A B C, then the next repetition B C A, ...): `arm_order` rotates the given order by one more
place for each repetition and each workload, so over N >= arms repetitions every arm runs in
every position alike and no arm always runs first. Each run is one `bench.lib.runner.run_one`:
fresh simulated replicas (cold caches; `--replicas`, real time unless `--time-scale`) with the
workload's KV-cache size, the router (`bench.lib.routers`; default DEFAULT_ROUTERS) in front of
them, the workload (`bench.lib.workloads`) replayed open loop, the same seeded sequence for every
router, then everything stopped and summarised (`bench.lib.stats`; the summary's `position` is
where the arm ran). The oracle bound (`bench.lib.oracle`) is computed once per workload and draw;
the finite-cache bound (`bench.lib.cache_bound`, the summary's `hit_bound`) once per run, over
the requests in the order that run sent them. `bench.lib.aggregate` folds the repetitions into
mean and min-max per (workload, router); the targets (`bench.lib.targets`) are checked on the means.

Paired ratios. `--reference ROUTER` (default REFERENCE, `prefix-epp-cache-aware`, the reference
policy on the picker's own path, where it runs): the report pairs every other arm with it by
repetition (the same draw, the same repetition) and gives each figure (hit rate, its share of the
placement reference, TTFT p50/p90/p99, the path's p99) as the mean over the repetitions with the
geometric mean of the per-repetition ratios arm / reference and its 95% Student-t interval on the
log ratios (`bench.lib.stats.paired_ratio`); an arm is better or worse only where that interval
excludes 1.

Writes to --out-dir (bench/results; `bench.lib.report`): {name}.json (config, oracle, the means as
`results`, their `spread`, every repetition's summaries, targets), {name}.md (the tables,
`bench.lib.tables`), {name}-ttft.png, {name}-ttft_p99.png, {name}-hit_rate.png, {name}-load.png;
each repetition's own report, the same files named {name}-r{k}, under runs/; and per-request
records under raw/ (not committed). `name` is "bench", or "bench-quick" with --quick. After every
run runs/{name}-r{k} holds repetition k so far, after every repetition {name} holds all so far,
so a long run that dies keeps what it measured. Each summary also carries `cpu_busy` (the
machine's CPU use during the run) and `start_lag_p99_ms` (how late the client sent against the
plan): both flag a machine too busy to trust the figures. The run prints its estimated length.

`--sim-profile` runs the simulated replicas as another replica model (`bench.lib.profiles`:
decode-bound, heterogeneous, minimal-metrics); results go to {name}-{profile}.

`--backend vllm` runs the same matrix on 2 real vLLM engines instead (`bench.lib.vllm_backend`:
vLLM's CPU build and a tiny model, started once for the whole matrix at niceness `--engine-nice`
(19), below the routers and the client, so the routers' path never waits for a core an engine
holds; both prefix caches reset and both engines idle before every run; restarted with a
workload's own engine flags where it has some, decode-heavy's `--max-num-seqs`), with
VLLM_ROUTERS and `--repeat` VLLM_REPEAT (5) unless named: the vLLM-sized workloads
(`VLLM_WORKLOADS` of `bench.lib.vllm_workloads`), the oracle at the engines' block size over the
model's real token ids, beside the usage-based hit rate the engines' own (their prefix-cache
counters), and per run the placement reference (`bench.lib.placement_reference`, the summary's
`hit_reference`: the hits a clairvoyant placement gets from caches that evict as vLLM's do, at
that run's times, and `hit_of_reference`, the run's hit rate as a share of it); results go to
bench-vllm by default. The clairvoyant reference reads the simulator's true caches, so it is
sim-only; `--replicas` and `--time-scale` do not apply. A router setup that fails against the
engines is reported under "Not run" with its error and skipped for the rest of the matrix.

    python -m bench.run --repeat 3            # `make bench`: 7 workloads x 8 routers x 3 = 168 runs, ~2.5 h on 2 cores
    python -m bench.run --quick               # a third of the requests, one repetition, ~20 min
    python -m bench.run --render-only         # rewrite tables and figures from the saved results
    python -m bench.run --render-only --name bench-r2   # the same for one repetition's report (runs/)
    python -m bench.run --workloads hot-prefix --routers prefix-epp least-request
    python -m bench.run --workloads mixed-length bursts --routers prefix-epp prefix-epp-weighted clairvoyant
    python -m bench.run --workloads hot-prefix --routers prefix-epp \\
        --picker-variant "--spill-absolute 2"  # also run prefix-epp with other flags
    python -m bench.run --workloads cache-pressure shared-prefix --routers prefix-epp prefix-epp-precise \\
        --closed-loop --name bench-precise     # precise vs approximate (KV events, closed-loop accuracy)
    python -m bench.run --backend vllm --vary-seed  # 6 workloads x 5 routers x 5 repetitions on 2 real engines,
                                                    # ~1.5 h; paired with prefix-epp-cache-aware
    LLMD_EPP=/path/to/epp python -m bench.run --workloads shared-prefix --routers prefix-epp llm-d llm-d-precise
    python -m bench.run --quick --sim-profile decode-bound --workloads hot-prefix bursts \
        --routers prefix-epp prefix-epp-weighted sglang-router clairvoyant   # another replica model

llm-d's router runs from the binary LLMD_EPP names (`bench.lib.llmd`); without it, and go-epp
without Go or a cached build, the report lists the setup under "Not run" with why.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from bench.lib import llmd, sim_vllm, vllm_backend
from bench.lib.aggregate import aggregate
from bench.lib.cache_bound import run_bound
from bench.lib.draws import Draw
from bench.lib.go_epp import build_info as go_epp_build_info
from bench.lib.oracle import pooled_oracle
from bench.lib.placement_reference import placement_figures
from bench.lib.profiles import PROFILES, SimProfile
from bench.lib.report import RESULTS, Summaries, raw_path, render_only, repetition_name, runs_dir, write_results
from bench.lib.routers import PICKER_TRANSPORT, ROUTERS, go_epp_available
from bench.lib.runner import REALTIME, RouterSpec, run_retrying
from bench.lib.tables import fmt
from bench.lib.vllm_workloads import VLLM_ONLY, VLLM_WORKLOADS, engine_args
from bench.lib.workloads import WORKLOADS, Workload

T = TypeVar("T")
V = TypeVar("V")
DEFAULT_REPLICAS = 4
# `make bench`: go-epp, llm-d, llm-d-precise and prefix-epp-precise run when named (--routers), not by default.
DEFAULT_ROUTERS = ("random", "round-robin", "least-request", "prefix-epp", "prefix-epp-cache-aware",
                   "prefix-epp-weighted", "sglang-router", "clairvoyant")
BACKENDS = ("sim", "vllm", "sim-vllm")
# --backend vllm's default: the in-picker policies through one path, sglang-router beside them as a
# peer, round-robin as the floor; clairvoyant is sim-only, go-epp and llm-d run when named.
VLLM_ROUTERS = ("round-robin", "prefix-epp", "prefix-epp-cache-aware", "prefix-epp-weighted", "sglang-router")
REFERENCE = "prefix-epp-cache-aware"  # --reference: the arm every other is paired with
VLLM_REPEAT = 5  # --repeat's default with --backend vllm
RUN_OVERHEAD_S = 8.0  # per run, on top of the planned load: start the setup, probe, drain, stop, write (2 cores)


def candidates_of(routers: Sequence[str]) -> list[str]:
    """The setups the goals are checked for: prefix-epp and its variants (not the peers or the
    reference policy)."""
    return [r for r in routers if r.startswith("prefix-epp") and r != REFERENCE]


def arm_order(arms: Sequence[T], repetition: int, workload: int = 0) -> list[T]:
    """The order the arms run in on one workload of one repetition (both counted from 0): the
    given order rotated left by repetition + workload. Over len(arms) repetitions every arm runs
    once in every position (a cyclic Latin square), so no arm always runs first, right after the
    engines' restart or next to the same neighbour's leftovers."""
    if not arms:
        return []
    k = (repetition + workload) % len(arms)
    return [*arms[k:], *arms[:k]]


def in_order(rows: dict[str, V], labels: Sequence[str]) -> dict[str, V]:
    return {label: rows[label] for label in labels if label in rows}


def failure(exc: BaseException) -> str:
    """The first line of an exception and the last line of the log it quotes, for a table note."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    head = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]
    return f"{head} ... {lines[-1][:200]}" if len(lines) > 1 else head


def estimate_s(workloads: Sequence[Workload], routers: int, repeat: int) -> float:
    """Expected wall time: every run's planned load plus RUN_OVERHEAD_S (start, drain, stop)."""
    return repeat * routers * sum(w.duration_s + RUN_OVERHEAD_S for w in workloads)


def run_all(workloads: Sequence[str], routers: Sequence[RouterSpec], *, quick: bool, replicas: int, load: float,
            time_scale: float, out_dir: Path, name: str, log: Callable[[str], None] = print,
            work_dir: Path | None = None, repeat: int = 1, seed: int = 0, vary_seed: bool = False,
            backend: str = "sim", profile: SimProfile = PROFILES["default"],
            replica_cost: float = 1.0, reference: str = REFERENCE, engine_nice: int = 0) -> dict[str, Any]:
    """The matrix `repeat` times, repetition-major, on the same seeded workloads (`seed`), or with
    `vary_seed` on a new draw of them per repetition (seed, seed + 1, ...); within a repetition,
    per workload, the routers one after another in `arm_order`; `backend` "vllm": on two real
    engines started once at niceness `engine_nice`; every arm paired with `reference` ("" for
    none) in the report (module docstring).

    After every run: runs/{name}-r{k} (repetition k so far); after every repetition: {name} (all so far).
    """
    config: dict[str, Any] = {"replicas": replicas, "time_scale": time_scale, "quick": quick, "load": load,
                              "repeat": repeat, "seed": seed, "vary_seed": vary_seed, "reference": reference,
                              "order": "per workload and repetition the arms run one after another, the given "
                                       "order rotated by one more place each repetition and workload "
                                       "(bench.run.arm_order)",
                              "closed_loop": any(r.closed_loop for r in routers), "workloads": {}}
    if replica_cost != 1:
        config["replica_cost"] = replica_cost
    if profile.name != "default":
        config["sim_profile"] = {"name": profile.name, "sim_args": list(profile.sim_args),
                                 "max_num_seqs": profile.max_num_seqs, "max_tokens": profile.max_tokens}
    if backend == "vllm":
        replicas, time_scale = vllm_backend.ENGINES, 1.0
        config |= {"replicas": replicas, "time_scale": time_scale, "backend": "vllm",
                   "engine": vllm_backend.engine_info(), "engine_nice": engine_nice}
    elif backend == "sim-vllm":
        replicas, time_scale = sim_vllm.ENGINES, 1.0
        config |= {"replicas": replicas, "time_scale": time_scale, "backend": "sim-vllm",
                   "profile": sim_vllm.load_profile()}
    if any(r.name == "go-epp" for r in routers):
        why = go_epp_available()
        if why:  # `make bench` on a machine without Go: the table says go-epp was not run, and why
            config["not_run"] = {"go-epp": why}
            routers = [r for r in routers if r.name != "go-epp"]
            log(f"go-epp not run: {why}")
        else:
            config["go_epp_build"] = go_epp_build_info()
    if any(r.name in llmd.SETUPS for r in routers):
        why = llmd.unavailable()
        if why:  # no LLMD_EPP binary: the table says llm-d was not run, and why
            for r in routers:
                if r.name in llmd.SETUPS:
                    config.setdefault("not_run", {})[r.label] = why
            routers = [r for r in routers if r.name not in llmd.SETUPS]
            log(f"llm-d not run: {why}")
        else:
            config["llmd_build"] = llmd.build_info()
    if any(r.realtime for r in routers):
        config["routers_realtime"] = " ".join(REALTIME)
    # Like for like between pickers: ext_proc TLS and KV events, which the table states.
    config["pickers"] = {r.label: {"tls": PICKER_TRANSPORT[r.name][0], "kv_events": PICKER_TRANSPORT[r.name][1]}
                         for r in routers if r.name in PICKER_TRANSPORT}
    candidates = candidates_of([r.label for r in routers])
    seeds = [seed + k for k in range(repeat)] if vary_seed else [seed] * repeat
    draws = {s: Draw.of(workloads, s, quick=quick, load=load, replicas=replicas, time_scale=time_scale,
                        backend=backend, profile=profile, replica_cost=replica_cost) for s in dict.fromkeys(seeds)}
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
    (out_dir / "raw").mkdir(parents=True, exist_ok=True)
    repetitions: list[Summaries] = []
    ttfts: dict[str, dict[str, list[float]]] = {}
    total, done, began = repeat * len(workloads) * len(routers), 0, time.monotonic()
    with tempfile.TemporaryDirectory(prefix="prefix-epp-bench-") as tmp_dir, contextlib.ExitStack() as stack:
        tmp_root = str(work_dir) if work_dir else tmp_dir
        engines = None
        if backend == "vllm":
            log(f"starting {vllm_backend.ENGINES} vLLM engines (once for the whole matrix)")
            engines = stack.enter_context(vllm_backend.started(Path(tmp_root) / "engines", engine_nice))
        for k in range(1, repeat + 1):
            rep: Summaries = {}
            rep_ttfts: dict[str, dict[str, list[float]]] = {}
            rep_name = repetition_name(name, k)
            draw = draws[seeds[k - 1]]
            built, sims = draw.workloads, draw.sims
            for w, (wname, workload) in enumerate(built.items()):
                if engines is not None and engines.configure(engine_args(wname)):
                    log(f"engines restarted for {wname}: `vllm serve` {' '.join(engine_args(wname)) or 'defaults'}")
                for position, router in enumerate(arm_order(routers, k - 1, w), start=1):
                    done += 1
                    if router.label in config.get("not_run", {}):
                        continue
                    t0 = time.monotonic()
                    try:
                        outcome = run_retrying(Path(tmp_root) / f"{wname}-{done}", workload, router, sims[wname],
                                               log, backend=engines)
                    except Exception as exc:
                        if engines is None:
                            raise
                        # Real engines: a setup that cannot run against them is reported, not fatal.
                        why = f"failed against real vLLM on {wname} (repetition {k}): {failure(exc)}"
                        config.setdefault("not_run", {})[router.label] = why
                        log(f"  {router.label} not run from here on: {why}")
                        continue
                    s = outcome.summary
                    room = sims[wname].replicas * sims[wname].kv_cache_blocks
                    s["hit_bound"] = round(run_bound(outcome.run.requests, draw.traces[wname], room).hit_rate, 4)
                    if engines is not None:
                        s.update(placement_figures(outcome.run.requests, draw.traces[wname],
                                                   [e.key for e in engines.engines]))
                        if s["hit_reference"] > 0:  # the run's hit rate as a share of its own reference
                            s["hit_of_reference"] = round(s["hit_rate"] / s["hit_reference"], 4)
                    s["position"] = position  # where the arm ran in this workload's turn (arm_order)
                    rep.setdefault(wname, {})[router.label] = s
                    samples = [r.ttft_s * 1000 for r in outcome.run.requests if r.ok and r.ttft_s is not None]
                    rep_ttfts.setdefault(wname, {})[router.label] = samples
                    ttfts.setdefault(wname, {}).setdefault(router.label, []).extend(samples)
                    raw_path(out_dir, rep_name, wname, router.label).write_text(
                        json.dumps([asdict(r) for r in outcome.run.requests]))
                    engine_hit = f" (engines {s['engine_hit_rate']:.1%})" if "engine_hit_rate" in s else ""
                    log(f"  [{done}/{total}] r{k} {wname} {router.label:<22} hit {s['hit_rate']:.1%}{engine_hit}  "
                        f"TTFT p50 {fmt(s['ttft_ms']['p50'])} p99 {fmt(s['ttft_ms']['p99'])} ms  "
                        f"max/mean load {s['replica_max_over_mean']:.2f}  errors {s['errors']}  "
                        f"cpu {s['cpu_busy']:.0%}  ({time.monotonic() - t0:.0f} s)")
                    labels = [r.label for r in routers]  # rows in the given order, whichever arm ran first
                    rep[wname], rep_ttfts[wname], ttfts[wname] = (in_order(d[wname], labels)
                                                                  for d in (rep, rep_ttfts, ttfts))
                    write_results(runs_dir(out_dir), rep_name, {**config, "raw_names": [rep_name]}, oracle, [rep],
                                  rep_ttfts, candidates)
            repetitions.append(rep)
            config["raw_names"] = [repetition_name(name, i) for i in range(1, k + 1)]
            targets = write_results(out_dir, name, config, oracle, repetitions, ttfts, candidates)
    log(f"done in {time.monotonic() - began:.0f} s; results in {out_dir}/{name}.md")
    means, _ = aggregate(repetitions)
    return {"summaries": means, "repetitions": repetitions, "oracle": oracle, "targets": targets}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, default="sim",
                   help="sim: fresh simulated replicas per run; vllm: 2 real vLLM engines (CPU build, tiny model); "
                        "sim-vllm: vllm's workloads on 2 simulated engines fitted to them (bench/fidelity.py)")
    p.add_argument("--quick", action="store_true", help="about a third of the requests per workload (vllm: half)")
    p.add_argument("--sim-profile", choices=PROFILES, default="default",
                   help="replica model (bench.lib.profiles): default, decode-bound, heterogeneous, minimal-metrics")
    p.add_argument("--workloads", nargs="+", choices=(*WORKLOADS, *VLLM_ONLY),
                   help=f"default: all (vllm: {' '.join(VLLM_WORKLOADS)})")
    p.add_argument("--routers", nargs="+", choices=ROUTERS,
                   help=f"default: {' '.join(DEFAULT_ROUTERS)} (vllm: {' '.join(VLLM_ROUTERS)})")
    p.add_argument("--picker-variant", action="append", default=[], metavar="FLAGS",
                   help="also run prefix-epp with these extra flags, e.g. '--spill-absolute 2' (repeatable)")
    p.add_argument("--closed-loop", action="store_true",
                   help="prefix-epp setups read every response's usage (--usage-sample-rate 1): prediction "
                        "accuracy on every request, at a picker round trip per streamed chunk")
    p.add_argument("--routers-realtime", action="store_true",
                   help="every router's processes (Envoy, the picker, sglang-router) run SCHED_FIFO: on cores the "
                        "engines keep busy no router waits for one, as beside GPU engines (needs root)")
    p.add_argument("--engine-nice", type=int, choices=range(20), default=vllm_backend.ENGINE_NICE, metavar="N",
                   help="--backend vllm: the engines run at this niceness, below the routers and the client, so "
                        "no exchange waits for a core an engine holds (0: as the routers; default "
                        f"{vllm_backend.ENGINE_NICE})")
    p.add_argument("--reference", metavar="ROUTER",
                   help=f"the arm every other is paired with, by repetition, in the report (default {REFERENCE} "
                        "where it runs; 'none': no paired ratios)")
    p.add_argument("--repeat", type=int,
                   help=f"run the whole matrix this many times (same workloads; default 1, vllm {VLLM_REPEAT})")
    p.add_argument("--replicas", type=int, default=DEFAULT_REPLICAS)
    p.add_argument("--replica-cost", type=float, default=1.0,
                   help="every simulated replica pays every cost this many times: more, smaller replicas "
                        "(--replicas 16 --replica-cost 4 holds the capacity of 4 default replicas)")
    p.add_argument("--seed", type=int, default=0,
                   help="workload seed: another draw of the same workloads (prompts, order, arrival times)")
    p.add_argument("--vary-seed", action="store_true",
                   help="repetition k runs the workloads drawn with seed + k - 1 (workload variance, not only noise)")
    p.add_argument("--load", type=float, default=1.0, help="multiply every arrival rate (calibration)")
    p.add_argument("--time-scale", type=float, default=1.0, help="simulator speed-up (1: real time)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--name", help="file name stem (default: bench, or bench-quick with --quick)")
    p.add_argument("--work-dir", type=Path, help="keep configs and process logs here (default: a temporary dir)")
    p.add_argument("--render-only", action="store_true", help="rewrite the tables and figures from saved results")
    args = p.parse_args(argv)
    vllm = args.backend in ("vllm", "sim-vllm")  # the vLLM-sized workloads
    repeat = args.repeat if args.repeat is not None else VLLM_REPEAT if vllm else 1
    if repeat < 1:
        p.error("--repeat must be at least 1")
    workloads = args.workloads or list(VLLM_WORKLOADS if vllm else WORKLOADS)
    chosen = args.routers or list(VLLM_ROUTERS if vllm else DEFAULT_ROUTERS)
    if args.backend == "vllm" and "clairvoyant" in chosen:
        p.error("clairvoyant is a simulator reference (it routes on the replicas' true caches and queues): "
                "it runs with --backend sim only")
    if args.replica_cost != 1 and (vllm or args.sim_profile == "heterogeneous"):
        p.error("--replica-cost applies to simulated replicas of one speed (not vllm, sim-vllm or heterogeneous)")
    if vllm and set(workloads) - set(VLLM_WORKLOADS):
        p.error(f"--backend vllm has vLLM-sized workloads for {', '.join(VLLM_WORKLOADS)} only")
    if not vllm and set(workloads) & set(VLLM_ONLY):
        p.error(f"{', '.join(VLLM_ONLY)}: vLLM-sized only (--backend vllm or sim-vllm); on the simulator, "
                "--sim-profile decode-bound")
    routers = [RouterSpec(r, closed_loop=args.closed_loop, realtime=args.routers_realtime) for r in chosen]
    routers += [RouterSpec("prefix-epp", tuple(shlex.split(v)), args.closed_loop, args.routers_realtime)
                for v in args.picker_variant]
    labels = [r.label for r in routers]
    reference = args.reference or (REFERENCE if REFERENCE in labels else "none")
    if reference != "none" and reference not in labels:
        p.error(f"--reference {reference}: not among the routers run ({', '.join(labels)})")
    name = args.name or (f"bench-{args.backend}" if vllm else "bench-quick" if args.quick else "bench")
    if args.sim_profile != "default" and not args.name:
        name = f"{name}-{args.sim_profile}"
    if args.render_only:
        print((render_only(args.out_dir, name) / f"{name}.md").read_text())
        return 0
    result = run_all(workloads, routers, quick=args.quick, replicas=args.replicas, load=args.load,
                     time_scale=args.time_scale, out_dir=args.out_dir, name=name,
                     log=lambda line: print(line, flush=True), work_dir=args.work_dir, repeat=repeat,
                     seed=args.seed, vary_seed=args.vary_seed, backend=args.backend,
                     profile=PROFILES[args.sim_profile], replica_cost=args.replica_cost,
                     reference="" if reference == "none" else reference,
                     engine_nice=args.engine_nice if args.backend == "vllm" else 0)
    print((args.out_dir / f"{name}.md").read_text())
    return 0 if result["summaries"] else 1


if __name__ == "__main__":
    sys.exit(main())
