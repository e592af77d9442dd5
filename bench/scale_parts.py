"""Where a decision's cost grows with the pool: the scheduler's parts timed at 4 and 256 endpoints.

`python -m bench.scale_parts` runs bench.scale_decide's approximate decision cell (the index at
capacity, prompts of one of 8 shared system prompts plus a part of their own, the event loop left
to run until idle between requests so the records after the answer are counted) at 4 and 256
endpoints, and times the calls of the scheduler's parts over the measured requests only: each
method below is wrapped by a timer (`perf_counter`, inclusive of what it calls; the wrappers add
well under a microsecond a call to each). Per part, microseconds per request, mean (min-max) of
the repetitions, and the difference from 4 to 256 endpoints: the part of the growth each explains.
The CPU per request beside them is the cell's own (process CPU over the measured loop, wrappers
included, so a little above bench.scale's).

Nesting: `schedule` holds the shortlist, the scoring, the lookup and `picked`; the shortlist holds
its ranking (`queue_costs`) and the least-waiting draw; `complete` (a request's end) holds the
index release. A decision's records are queued and made by the next index call or the event
loop's next turn, whichever comes first (extproc/scheduling/scheduler.py); here a request's end
follows its decision at once, so they are made inside the release, and `index records` counts
them once more on their own. Not a bound on anything: where the time goes, for whoever makes it
smaller.

Writes bench/results/scale-parts.json and scale-parts.md.

    python -m bench.scale_parts                       # 3 repetitions, 1k and 8k tokens, ~3 min
    python -m bench.scale_parts --tokens 1000 --repeat 1
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.scale_decide import decision_cells
from extproc.config.settings import EppConfig
from extproc.control.director import Director
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.scheduler import Scheduler
from extproc.scheduling.scorers.predicted_ttft import PredictedTtftScorer
from extproc.scheduling.shortlist import Shortlist

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = (4, 256)

# (class, method, label), in the order of the table.
PARTS: tuple[tuple[type, str, str], ...] = (
    (Director, "route", "route (parse, hash, schedule)"),
    (Scheduler, "schedule", "schedule"),
    (Shortlist, "select", "shortlist"),
    (PredictedTtftScorer, "queue_costs", "shortlist: ranking"),
    (PredictedTtftScorer, "least_waiting", "shortlist: least-waiting draw"),
    (PredictedTtftScorer, "score", "scoring"),
    (PrefixIndex, "match", "index lookup"),
    (PredictedTtftScorer, "picked", "picked (the model told)"),
    (PrefixIndex, "flush", "index records"),
    (Director, "complete", "response end"),
    (PrefixIndex, "release", "response end: index release"),
)


class PartTimer:
    """Wraps PARTS' methods while installed; counts only between `enable` and `disable` (the
    profiler hook of bench.scale_decide.decision_cells, so the index fill and warm-up are left out)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {label: 0.0 for _, _, label in PARTS}
        self.calls: dict[str, int] = {label: 0 for _, _, label in PARTS}
        self.on = False

    def enable(self) -> None:
        self.on = True

    def disable(self) -> None:
        self.on = False

    def _wrap(self, f: Callable[..., Any], label: str) -> Callable[..., Any]:
        clock = time.perf_counter

        @functools.wraps(f)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return f(*args, **kwargs)
            start = clock()
            try:
                return f(*args, **kwargs)
            finally:
                self.seconds[label] += clock() - start
                self.calls[label] += 1
        return timed

    @contextmanager
    def installed(self) -> Iterator[PartTimer]:
        saved = [(cls, name, cls.__dict__[name]) for cls, name, _ in PARTS]
        try:
            for cls, name, label in PARTS:
                setattr(cls, name, self._wrap(cls.__dict__[name], label))
            yield self
        finally:
            for cls, name, original in saved:
                setattr(cls, name, original)


def measure(endpoints: int, tokens: int, requests: int) -> dict[str, Any]:
    timer = PartTimer()
    with timer.installed():
        row = decision_cells(endpoints, "approximate", [tokens], lambda _: requests, profiler=timer)[0]
    n = row["requests"]
    return {"endpoints": endpoints, "tokens": tokens, "requests": n,
            "cpu_us_per_request": row["cpu_ms_per_request"] * 1e3,
            "scored": min(endpoints, EppConfig().max_scored_endpoints or endpoints),
            "parts_us": {label: s / n * 1e6 for label, s in timer.seconds.items()},
            "calls_per_request": {label: c / n for label, c in timer.calls.items()}}


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.mean(values):,.1f} ({min(values):,.1f}-{max(values):,.1f})"


def render(rows: list[dict[str, Any]], tokens: Sequence[int], repeat: int) -> str:
    out = ["# Where a decision's cost grows with the pool (`python -m bench.scale_parts`)", "",
           __doc__.split("\n\n")[1].replace("\n", " "), "",
           f"Approximate mode; repetitions: {repeat}; microseconds per request, mean (min-max); "
           "the last column: the growth from 4 to 256 endpoints, on the means.", ""]
    for t in tokens:
        cells = {n: [r for r in rows if r["endpoints"] == n and r["tokens"] == t] for n in SIZES}
        head = " | ".join(f"{n} endpoints" for n in SIZES)
        out += [f"## {t:,} tokens", "", f"| part | {head} | growth |", "|---|" + "---:|" * (len(SIZES) + 1)]
        means: dict[int, float] = {}
        for n in SIZES:
            means[n] = statistics.mean(r["cpu_us_per_request"] for r in cells[n])
        out.append("| **CPU per request** | " + " | ".join(
            _spread([r["cpu_us_per_request"] for r in cells[n]]) for n in SIZES)
            + f" | +{means[SIZES[-1]] - means[SIZES[0]]:,.0f} (x{means[SIZES[-1]] / means[SIZES[0]]:.2f}) |")
        for _, _, label in PARTS:
            per = {n: [r["parts_us"][label] for r in cells[n]] for n in SIZES}
            growth = statistics.mean(per[SIZES[-1]]) - statistics.mean(per[SIZES[0]])
            out.append(f"| {label} | " + " | ".join(_spread(per[n]) for n in SIZES) + f" | {growth:+,.0f} |")
        scored = {n: cells[n][0]["scored"] for n in SIZES}
        per_candidate = {n: statistics.mean(r["parts_us"]["scoring"] for r in cells[n]) / scored[n] for n in SIZES}
        out += ["", "Candidates scored: " + ", ".join(f"{scored[n]} at {n} endpoints" for n in SIZES)
                + "; scoring per candidate (including the call's fixed part): "
                + ", ".join(f"{per_candidate[n]:.1f} us at {n}" for n in SIZES) + ".", ""]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1000, 8000])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    rows = []
    for rep in range(args.repeat):  # repetition-major: drift hits both pool sizes alike
        for t in args.tokens:
            for n in SIZES:
                row = measure(n, t, args.requests)
                row["repetition"] = rep + 1
                rows.append(row)
                print(f"r{rep + 1} {n} endpoints, {t} tokens: CPU {row['cpu_us_per_request']:.0f} us/request",
                      flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "scale-parts.json").write_text(json.dumps({"repeat": args.repeat, "rows": rows}, indent=1) + "\n")
    (args.out_dir / "scale-parts.md").write_text(render(rows, args.tokens, args.repeat) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
