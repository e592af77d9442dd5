"""Repetitions of the benchmark matrix folded into one row per (workload, router): mean and min-max.

`python -m bench.run --repeat N` runs the whole matrix N times, repetition-major, on the same
seeded workloads, so the spread measures the machine's noise and drift hits every router alike.
Each repetition yields `Summaries` (summaries[workload][router] = a `bench.lib.stats.summarize` row).

- `mean_row(rows)`: the row of a (workload, router) averaged over the repetitions that ran it:
  every number is the arithmetic mean (NaN stays NaN), nested dicts recurse, anything else
  comes from the first row. `requests_per_replica` is special: replica addresses change from
  run to run, so each run's counts are sorted busiest first and averaged by rank ("#1", "#2", ...).
- `spread_row(rows)`: min and max over the repetitions of the SPREAD figures (hit rate, TTFT
  p50/p90/p99, e2e p50/p99, load balance max/mean, decision latency p50/p99, and on real vLLM the
  engines' own hit rate), by dotted path.
- `aggregate(repetitions)`: (means, spreads) for every (workload, router) of any repetition, in
  first-seen order; the tables, figures and targets use the means, the tables add the spread.
- `pairs(repetitions, workload, router, reference, path)`: the figure at `path` for `router` and
  for `reference`, one pair per repetition that ran both on `workload` (the same draw, the same
  repetition), for `bench.lib.stats.paired_ratio`.
- `paired_figures(repetitions, reference)`: for every workload the reference ran and every arm
  beside it, each figure of PAIRED (hit rates, TTFT p50/p90/p99, the path's p99) as its mean
  over the repetitions with the paired ratio to the reference, its 95% interval, the pairs it
  rests on and the verdict (`bench.lib.stats.paired_ratio`, `verdict`).
- `cell(value, spread, fmt)`: "1,914 (1,850-2,010)"; without a spread (one repetition) the value alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bench.lib.stats import paired_ratio, verdict

Row = Mapping[str, Any]
Summaries = Mapping[str, Mapping[str, Row]]
Spread = dict[str, tuple[float, float]]  # dotted metric path -> (min, max)

SPREAD = ("hit_rate", "ttft_ms.p50", "ttft_ms.p90", "ttft_ms.p99", "e2e_ms.p50", "e2e_ms.p99",
          "replica_max_over_mean", "decision_ms.p50", "decision_ms.p99", "engine_hit_rate", "hit_of_reference",
          "gateway_ms.p50", "gateway_ms.p99")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def mean_row(rows: Sequence[Row]) -> dict[str, Any]:
    """The mean of `summarize` rows (one per repetition) as a row of the same shape."""
    if not rows:
        raise ValueError("no rows to average")
    out: dict[str, Any] = {}
    for key, first in rows[0].items():
        present = [r[key] for r in rows if key in r]
        if key == "requests_per_replica":
            ranked = [sorted(counts.values(), reverse=True) for counts in present]
            width = max(len(r) for r in ranked)
            out[key] = {f"#{i + 1}": _mean([r[i] if i < len(r) else 0 for r in ranked]) for i in range(width)}
        elif _is_number(first) and all(_is_number(v) for v in present):
            out[key] = _mean([float(v) for v in present])
        elif isinstance(first, Mapping) and all(isinstance(v, Mapping) for v in present):
            out[key] = mean_row(present)
        else:
            out[key] = first
    return out


def lookup(row: Row, path: str) -> float | None:
    value: Any = row
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return float(value) if _is_number(value) else None


def spread_row(rows: Sequence[Row]) -> Spread:
    out: Spread = {}
    for path in SPREAD:
        values = [v for v in (lookup(r, path) for r in rows) if v is not None]
        if values:
            out[path] = (min(values), max(values))
    return out


def aggregate(repetitions: Sequence[Summaries]) -> tuple[dict[str, dict[str, dict[str, Any]]],
                                                         dict[str, dict[str, Spread]]]:
    """(means, spreads), each [workload][router], over every repetition that ran the pair."""
    grouped: dict[str, dict[str, list[Row]]] = {}
    for summaries in repetitions:
        for workload, rows in summaries.items():
            for router, row in rows.items():
                grouped.setdefault(workload, {}).setdefault(router, []).append(row)
    means = {w: {r: mean_row(rows) for r, rows in routers.items()} for w, routers in grouped.items()}
    spreads = {w: {r: spread_row(rows) for r, rows in routers.items()} for w, routers in grouped.items()}
    return means, spreads


def pairs(repetitions: Sequence[Summaries], workload: str, router: str, reference: str,
          path: str) -> tuple[list[float], list[float]]:
    """(router's values, reference's values) of `path`, paired by repetition; NaN where a row
    lacks the figure (paired_ratio leaves such pairs out)."""
    values: list[float] = []
    refs: list[float] = []
    for summaries in repetitions:
        rows = summaries.get(workload, {})
        if router in rows and reference in rows:
            x, r = lookup(rows[router], path), lookup(rows[reference], path)
            values.append(math.nan if x is None else x)
            refs.append(math.nan if r is None else r)
    return values, refs


# Paired against the reference: (dotted path, higher is better).
PAIRED = (("hit_rate", True), ("hit_of_reference", True), ("ttft_ms.p50", False), ("ttft_ms.p90", False),
          ("ttft_ms.p99", False), ("gateway_ms.p99", False))


def paired_figures(repetitions: Sequence[Summaries], reference: str) -> dict[str, dict[str, dict[str, Any]]]:
    """[workload][arm][path] -> {mean, ratio, low, high, n, verdict} (module docstring); the
    reference's own row has its means only. Workloads without the reference are left out, and so
    are figures no repetition of an arm has."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    arms: dict[str, list[str]] = {}
    for summaries in repetitions:
        for workload, rows in summaries.items():
            seen = arms.setdefault(workload, [])
            seen += [r for r in rows if r not in seen]
    for workload, routers in arms.items():
        if reference not in routers:
            continue
        for router in routers:
            figures: dict[str, Any] = {}
            for path, higher in PAIRED:
                runs = [lookup(rows[workload][router], path) for rows in repetitions
                        if router in rows.get(workload, {})]
                finite = [v for v in runs if v is not None and math.isfinite(v)]
                if not finite:
                    continue
                figure: dict[str, Any] = {"mean": _mean(finite)}
                if router != reference:
                    p = paired_ratio(*pairs(repetitions, workload, router, reference, path))
                    figure |= {"ratio": p.ratio, "low": p.low, "high": p.high, "n": p.n,
                               "verdict": verdict(p, higher)}
                figures[path] = figure
            out.setdefault(workload, {})[router] = figures
    return out


def cell(value: float, spread: tuple[float, float] | None, fmt: Callable[[float], str]) -> str:
    """`value` formatted, with the min-max range when there is one: '1,914 (1,850-2,010)'."""
    if spread is None:
        return fmt(value)
    return f"{fmt(value)} ({fmt(spread[0])}-{fmt(spread[1])})"
