"""How the picker's cost grows with the pool and the prompts (`python -m bench.scale`).

Parts (each can run alone with `--part`, e.g. one per turn of the shared CPU lock; every
repetition is written to bench/results/runs/scale-<part>-r<k>.json, and `--render` combines
whatever runs are there into bench/results/scale.json, scale.md and the scale-*.png plots):
- `scrape` (bench/scale_scrape.py): the scraper's CPU, rate and freshness at 4, 16, 64, 256
  endpoints, the fixed-interval design against the budgeted one;
- `decision` (bench/scale_decide.py): in-process decision latency p50/p99 and CPU per request at
  4, 16, 64, 256 endpoints x 1k, 8k, 32k, 128k-token prompts, approximate and precise, the index
  at capacity;
- `tokenize`: the builtin tokenizer on 128k-token prompts, cold and with a cached prefix;
- `memory`: resident memory of each index at capacity against endpoints (a fresh process each);
- `stalls` (bench/scale_stalls.py): the longest pause an index update puts on the event loop,
  each index churned at capacity for one turnover at 16, 64, 256 endpoints (a fresh process each).
  `--label L` tags a run's rows (`code`: L) and its files (scale-<part>-L-r<k>.json), so a run
  of an earlier commit's code (the same bench files in its tree) renders beside the current one
  (the stalls and decision parts).
Without `--part`, every part runs and the results are rendered. `--quick`: fewer requests and
seconds, for a look (not for committed figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.scale_decide import decision_cells, tokenize
from bench.scale_scrape import client_costs, scrape_costs
from bench.scale_stalls import turnover

PARTS = ("scrape", "decision", "tokenize", "memory", "stalls")
STALL_SIZES = (16, 64, 256)
SIZES = (4, 16, 64, 256)
LENGTHS = (1000, 8000, 32000, 128000)
MODES = ("approximate", "precise")


def requests_for(tokens: int, quick: bool) -> int:
    n = 300 if tokens <= 8000 else 200 if tokens <= 32000 else 100
    return max(20, n // 10) if quick else n


def _fresh(call: str) -> dict[str, Any]:
    """`call` (an expression of bench.scale_decide / bench.scale_stalls) in a fresh process: its JSON."""
    out = subprocess.run([sys.executable, "-c", "import json; from bench.scale_decide import index_memory; "
                          f"from bench.scale_stalls import index_stalls; print(json.dumps({call}))"],
                         check=True, capture_output=True, text=True)
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return row


def run_part(part: str, quick: bool, log_dir: Path, label: str = "",
             max_scored: int | None = None) -> list[dict[str, Any]]:
    if part == "scrape":
        return [client_costs(log_dir), *scrape_costs(SIZES, 3.0 if quick else 10.0, log_dir)]
    if part == "decision":
        rows = []
        for mode in MODES:
            for n in SIZES:
                for row in decision_cells(n, mode, LENGTHS, lambda t: requests_for(t, quick), max_scored=max_scored):
                    print(f"decision {mode} {n} endpoints {row['tokens']} tokens: p50 {row['p50_ms']:.2f} "
                          f"p99 {row['p99_ms']:.2f} ms, CPU {row['cpu_ms_per_request']:.2f} ms", flush=True)
                    rows.append({"code": label or "current", **row})
        return rows
    if part == "tokenize":
        return [tokenize(t, 2 if quick else 5) for t in (32000, 128000)]
    rows = []
    if part == "stalls":
        for kind in MODES:
            for n in STALL_SIZES:
                records = turnover(kind, n) // (10 if quick else 1)
                rows.append({"code": label or "current", **_fresh(f"index_stalls({kind!r}, {n}, {records})")})
                print(f"stalls {kind} {n}: max {rows[-1]['max_ms']:.1f} ms, p99 {rows[-1]['p99_ms']:.2f} ms",
                      flush=True)
        return rows
    for kind in MODES:
        for n in SIZES:
            rows.append(_fresh(f"index_memory({kind!r}, {n})"))
            print(f"memory {kind} {n}: {rows[-1]['rss_mb']:.0f} MB", flush=True)
    return rows


KEYS = {"scrape": ("endpoints", "design"), "decision": ("code", "mode", "endpoints", "tokens"),
        "tokenize": ("tokens",), "memory": ("kind", "endpoints"), "stalls": ("code", "kind", "endpoints")}


def combine(runs: Sequence[list[dict[str, Any]]], keys: Sequence[str]) -> list[dict[str, Any]]:
    """Rows of several repetitions merged by their key fields: each number as mean, min, max."""
    merged: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for rows in runs:
        for row in rows:
            merged.setdefault(tuple(row.get(k, "current") if k == "code" else row[k] for k in keys), []).append(row)
    out = []
    for group in merged.values():
        merged_row: dict[str, Any] = {k: group[0].get(k, "current") if k == "code" else group[0][k] for k in keys}
        for field, value in group[0].items():
            if field in keys or not isinstance(value, int | float):
                continue
            values = [g[field] for g in group]
            merged_row[field] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
        merged_row["reps"] = len(group)
        out.append(merged_row)
    return out


def load_runs(runs_dir: Path) -> dict[str, list[dict[str, Any]]]:
    doc: dict[str, list[dict[str, Any]]] = {}
    for part in PARTS:
        files = sorted({*runs_dir.glob(f"scale-{part}-r*.json"), *runs_dir.glob(f"scale-{part}-*-r*.json")})
        if files:
            doc[part] = combine([json.loads(f.read_text())["rows"] for f in files], KEYS[part])
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=PARTS, action="append", help="run only these parts (repeatable)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--first-rep", type=int, default=1, help="number of the first repetition written")
    ap.add_argument("--render", action="store_true", help="only combine the runs there into the results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--label", default="", help="tag this run's rows and files (the stalls part: an earlier commit)")
    ap.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    ap.add_argument("--max-scored-endpoints", type=int, default=None,
                    help="the decision part: the picker's --max-scored-endpoints, if not its default (tag the rows "
                         "with --label)")
    args = ap.parse_args(argv)
    runs_dir = args.out_dir / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    if not args.render:
        with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
            for part in args.part or PARTS:
                reps = 1 if part == "memory" else args.reps
                for k in range(args.first_rep, args.first_rep + reps):
                    rows = run_part(part, args.quick, Path(tmp), args.label, args.max_scored_endpoints)
                    tag = f"-{args.label}" if args.label else ""
                    (runs_dir / f"scale-{part}{tag}-r{k}.json").write_text(
                        json.dumps({"part": part, "rep": k, "quick": args.quick, "rows": rows}, indent=1) + "\n")
    if args.render or not args.part:
        from bench.scale_report import render
        doc = load_runs(runs_dir)
        (args.out_dir / "scale.json").write_text(json.dumps(doc, indent=1) + "\n")
        md = render(doc, args.out_dir)
        (args.out_dir / "scale.md").write_text(md)
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
