"""prefix-epp against the Go endpoint picker over repeated benchmark runs: median and spread.

Reads the results files of several `python -m bench.run --routers prefix-epp go-epp --name NAME-rK`
runs (each one run of every workload with both routers side by side) and writes one table: for
each workload and router the median over the runs and, in brackets, the lowest and highest value,
of hit rate, TTFT p50/p90/p99, load spread (busiest replica's requests over the mean), router
CPU per request (picker + Envoy processes), decision latency p99 and errors; then, per workload,
which router is ahead on each figure in how many of the runs.

    python -m bench.peers.compare bench/results/runs/bench-go-epp-r1.json \\
        bench/results/runs/bench-go-epp-r2.json bench/results/runs/bench-go-epp-r3.json \\
        --out bench/results/bench-go-epp.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]
# name -> (how to read it from a summary row, format, lower is better)
FIGURES: dict[str, tuple[Callable[[Row], float], str, bool]] = {
    "hit rate": (lambda r: float(r["hit_rate"]) * 100, "{:.1f}%", False),
    "TTFT p50 (ms)": (lambda r: float(r["ttft_ms"]["p50"]), "{:,.0f}", True),
    "TTFT p90 (ms)": (lambda r: float(r["ttft_ms"]["p90"]), "{:,.0f}", True),
    "TTFT p99 (ms)": (lambda r: float(r["ttft_ms"]["p99"]), "{:,.0f}", True),
    "load max/mean": (lambda r: float(r["replica_max_over_mean"]), "{:.2f}", True),
    "router CPU (ms/req)": (lambda r: float(r.get("router_cpu_ms_per_request", float("nan"))), "{:.2f}", True),
    "decision p99 (ms)": (lambda r: float(r.get("decision_ms", {}).get("p99", float("nan"))), "{:.2f}", True),
    "errors": (lambda r: float(r["errors"]), "{:.0f}", True),
}


def load(paths: Sequence[Path]) -> list[dict[str, dict[str, Row]]]:
    return [json.loads(p.read_text())["results"] for p in paths]


def cell(values: list[float], fmt: str) -> str:
    if not values or any(v != v for v in values):
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} [{fmt.format(min(values))} to {fmt.format(max(values))}]"


def table(runs: list[dict[str, dict[str, Row]]], routers: Sequence[str]) -> str:
    head = "| workload | router | " + " | ".join(FIGURES) + " |"
    lines = [head, "|---|---|" + "---:|" * len(FIGURES)]
    for workload in runs[0]:
        for router in routers:
            rows = [run[workload][router] for run in runs if router in run.get(workload, {})]
            cells = [cell([get(r) for r in rows], fmt) for get, fmt, _ in FIGURES.values()]
            lines.append(f"| {workload} | {router} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(runs: list[dict[str, dict[str, Row]]], ours: str, theirs: str) -> str:
    """Per workload and figure: in how many runs `ours` was ahead of `theirs` (ties count for neither)."""
    lines = ["| workload | " + " | ".join(f for f in FIGURES if f != "errors") + " |",
             "|---|" + "---|" * (len(FIGURES) - 1)]
    for workload in runs[0]:
        cells = []
        for name, (get, _, lower_better) in FIGURES.items():
            if name == "errors":
                continue
            ahead = behind = 0
            for run in runs:
                a, b = get(run[workload][ours]), get(run[workload][theirs])
                if a != a or b != b or a == b:
                    continue
                if (a < b) == lower_better:
                    ahead += 1
                else:
                    behind += 1
            cells.append(f"{ahead} ahead / {behind} behind")
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--ours", default="prefix-epp")
    p.add_argument("--theirs", default="go-epp")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    runs = load(args.results)
    build = json.loads(args.results[0].read_text())["config"].get("go_epp_build", {})
    md = [f"{args.ours} vs {args.theirs} over {len(runs)} runs ({', '.join(p.name for p in args.results)}); "
          "each run has both routers side by side on fresh replicas per workload. Cells: median "
          "[lowest to highest].", "",
          f"{args.theirs}: {build.get('module', '')} ({build.get('go', '')}).", "",
          table(runs, [args.ours, args.theirs]), "",
          f"Runs in which {args.ours} was ahead of {args.theirs}:", "", verdicts(runs, args.ours, args.theirs), ""]
    text = "\n".join(md)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
