"""The ablation of the default scheduler: each mechanism off against the default, on the simulator's replica models.

For each replica model (`--profiles`, bench.lib.profiles: default, decode-bound, heterogeneous,
minimal-metrics) and each workload some chosen mechanism claims (bench.lib.ablation.MECHANISMS),
repetition k draws the workload with seed `--seed` + k - 1 and runs the arms on it one after the
other: the default picker, then the picker with each such mechanism off (`--ablate NAME`, or the
flag that already turns it off), in reverse order on every other repetition (ABBA), so drift of
the machine meets every arm alike. Every run is bench.run's (`bench.lib.runner.run_retrying`:
fresh simulated replicas, Envoy and the picker, the workload open loop). The figures are each
mechanism's paired ratios off / on over the repetitions (TTFT p50, p99, hit rate; geometric mean
and 95% interval, `bench.lib.ablation.paired_ratio`), per replica model and workload.

Writes --out-dir/{name}.json (config, every run's figures, the ratios) and {name}.md (the table),
both after every run, so a long matrix that dies keeps what it measured.

    python -m bench.ablation --repeat 5 --quick                           # the whole matrix (many hours)
    python -m bench.ablation --mechanisms first-token-bound slot-wait --profiles decode-bound --repeat 5 --quick
    python -m bench.ablation --mechanisms pins --profiles default --workloads cache-pressure --repeat 1 --quick
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.lib.ablation import MECHANISMS, ON, Ratio, arms, cell, paired_ratio, picker_args
from bench.lib.draws import Draw
from bench.lib.profiles import PROFILES
from bench.lib.report import RESULTS
from bench.lib.runner import RouterSpec, run_retrying
from bench.lib.workloads import WORKLOADS
from bench.run import DEFAULT_REPLICAS

METRICS = (("ttft_p50", False), ("ttft_p99", False), ("hit_rate", True))  # (figure, higher is better)


def figures(summary: dict[str, Any]) -> dict[str, float]:
    return {"ttft_p50": summary["ttft_ms"]["p50"], "ttft_p99": summary["ttft_ms"]["p99"],
            "hit_rate": summary["hit_rate"], "cpu_busy": summary.get("cpu_busy") or 0.0}


def ratios(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (mechanism, profile, workload): the paired ratios off / on of each metric, over the seeds
    where both arms ran."""
    cells: dict[tuple[str, str, str], dict[int, dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault((r["profile"], r["workload"], r["arm"]), {})[r["seed"]] = r
    out = []
    for (profile, workload, arm), by_seed in cells.items():
        if arm == ON:
            continue
        base = cells.get((profile, workload, ON), {})
        seeds = sorted(set(by_seed) & set(base))
        row: dict[str, Any] = {"mechanism": arm, "profile": profile, "workload": workload, "n": len(seeds)}
        for metric, _ in METRICS:
            ratio = paired_ratio([by_seed[s][metric] for s in seeds], [base[s][metric] for s in seeds])
            row[metric] = {"mean": ratio.mean, "lo": ratio.lo, "hi": ratio.hi}
        out.append(row)
    return sorted(out, key=lambda row: (row["mechanism"], row["profile"], row["workload"]))


def render(data: dict[str, Any]) -> str:
    c = data["config"]
    lines = ["# Ablation of the default scheduler (`python -m bench.ablation`)", "",
             f"Command: `{c['command']}` ({c['date']}). Simulated replicas ({c['replicas']}, time scale "
             f"{c['time_scale']:g}), {'`--quick` ' if c['quick'] else ''}workloads drawn anew per repetition "
             "(seed + k), arms interleaved (ABBA). Each cell: the paired ratio off / on over the repetitions, "
             "geometric mean (95% interval). TTFT above 1 or hit rate below 1 means the mechanism helps; "
             "'pays' / 'costs' only where the interval excludes 1. What each mechanism is: docs/ablation.md.", "",
             "| mechanism | replica model | workload | n | TTFT p50 off/on | TTFT p99 off/on | hit rate off/on | "
             "verdict |", "|---|---|---|---:|---:|---:|---:|---|"]
    for row in data["ratios"]:
        rs = {m: Ratio(**row[m], n=row["n"]) for m, _ in METRICS}
        verdicts = sorted({v for m, better in METRICS if (v := rs[m].verdict(better))})
        lines.append(f"| {row['mechanism']} | {row['profile']} | {row['workload']} | {row['n']} | "
                     f"{cell(rs['ttft_p50'])} | {cell(rs['ttft_p99'])} | {cell(rs['hit_rate'])} | "
                     f"{' / '.join(verdicts) or 'within spread'} |")
    busy = [r["cpu_busy"] for r in data["runs"]]
    if busy:
        lines += ["", f"{len(busy)} runs; machine CPU busy during the runs: mean {sum(busy) / len(busy):.0%}, "
                      f"max {max(busy):.0%}."]
    return "\n".join(lines) + "\n"


def write(out_dir: Path, name: str, config: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    data = {"config": config, "runs": runs, "ratios": ratios(runs)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out_dir / f"{name}.md").write_text(render(data))
    return data


def run_matrix(mechanisms: Sequence[str], profiles: Sequence[str], workloads: Sequence[str] | None, *,
               repeat: int, seed: int, quick: bool, replicas: int, time_scale: float, out_dir: Path, name: str,
               command: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    chosen = sorted({w for m in mechanisms for w in MECHANISMS[m].workloads if workloads is None or w in workloads},
                    key=WORKLOADS.index)
    config = {"command": command, "date": datetime.now(UTC).strftime("%Y-%m-%d"), "mechanisms": list(mechanisms),
              "profiles": list(profiles), "workloads": chosen, "repeat": repeat, "seed": seed, "quick": quick,
              "replicas": replicas, "time_scale": time_scale,
              "arms": {m: list(MECHANISMS[m].off) for m in mechanisms}}
    plan = [(p, w, k) for p in profiles for w in chosen for k in range(repeat)]
    total = sum(len(arms(w, mechanisms)) for _, w, _ in plan)
    log(f"{total} runs: {len(profiles)} replica models x {len(chosen)} workloads x {repeat} repetitions")
    runs: list[dict[str, Any]] = []
    data = write(out_dir, name, config, runs)
    done, began = 0, time.monotonic()
    with tempfile.TemporaryDirectory(prefix="prefix-epp-ablation-") as tmp:
        for profile, workload, k in plan:
            draw = Draw.of([workload], seed + k, quick=quick, load=1.0, replicas=replicas, time_scale=time_scale,
                           profile=PROFILES[profile])
            order = arms(workload, mechanisms)
            for arm in order if k % 2 == 0 else order[::-1]:
                done += 1
                spec = RouterSpec("prefix-epp", picker_args(arm))
                outcome = run_retrying(Path(tmp) / f"run-{done}", draw.workloads[workload], spec,
                                       draw.sims[workload], log)
                row = {"profile": profile, "workload": workload, "seed": seed + k, "arm": arm,
                       **figures(outcome.summary)}
                runs.append(row)
                log(f"[{done}/{total}] {profile} {workload} seed {seed + k} {arm}: TTFT p50 {row['ttft_p50']:.0f} "
                    f"p99 {row['ttft_p99']:.0f} ms, hit {row['hit_rate']:.1%}, cpu {row['cpu_busy']:.0%} "
                    f"({time.monotonic() - began:.0f} s)")
                data = write(out_dir, name, config, runs)
    return data


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mechanisms", nargs="+", choices=MECHANISMS, default=list(MECHANISMS))
    p.add_argument("--profiles", nargs="+", choices=PROFILES, default=list(PROFILES))
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS,
                   help="only these of the mechanisms' workloads (default: every one some mechanism claims)")
    p.add_argument("--repeat", type=int, default=5, help="repetitions, each on its own draw (seed + k)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="about a third of the requests per workload")
    p.add_argument("--replicas", type=int, default=DEFAULT_REPLICAS)
    p.add_argument("--time-scale", type=float, default=1.0, help="simulator speed-up (1: real time)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--name", default="ablation")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    command = "python -m bench.ablation " + " ".join(argv if argv is not None else sys.argv[1:])
    data = run_matrix(args.mechanisms, args.profiles, args.workloads, repeat=args.repeat, seed=args.seed,
                      quick=args.quick, replicas=args.replicas, time_scale=args.time_scale, out_dir=args.out_dir,
                      name=args.name, command=command.strip(), log=lambda line: print(line, flush=True))
    print(render(data))
    return 0 if data["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
