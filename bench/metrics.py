"""The benchmark's arithmetic: pure functions from measured requests to the reported figures.

- `percentile(values, q)`: nearest rank (`bench.overhead.percentile`), q in percent.
- `hit_rate`: cached prompt tokens / prompt tokens over the successful requests, as the
  replicas reported them in `usage`.
- `histogram_quantile(q, buckets)`: Prometheus' estimate from cumulative buckets: find the
  bucket holding rank q x count and interpolate linearly inside it (the first bucket starts at
  0; a rank in the +Inf bucket returns the highest finite bound).
- `prefill_work_s`: model time the replicas spent computing prompt tokens that missed the cache
  (uncached tokens x the simulator's `prefill_time_per_token`, 0.06 ms): the GPU work prefix
  caching saves, independent of how the load was spread.
- `replica_load`: requests per replica (every replica listed, idle ones as 0), max, mean and
  max / mean.
- `prediction_accuracy(text)`: the picker's closed loop per scorer (approximate, precise), from
  its /metrics: predictions compared with the replicas' usage, the share within one block
  (`..._predicted_within_one_block_total / ..._predictions_total`) and the mean absolute error in
  tokens (`..._prediction_error_tokens_sum / _count`).
- `summarize`: one router on one workload -> the row of the results table.
- `evaluate_targets`: the benchmark goals, checked against the summaries (see TARGETS; `bench.run`
  passes the means over the repetitions).
- `relative_to`: every router's hit rate and TTFT p99 as a fraction of the clairvoyant reference's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.client import RequestResult
from bench.overhead import percentile
from extproc.scraping.prom_text import samples
from prefix_epp_sim.config import SimConfig

__all__ = ["Target", "evaluate_targets", "histogram_quantile", "hit_rate", "parse_histogram", "percentile",
           "prediction_accuracy", "prefill_work_s", "relative_to", "replica_load", "summarize"]

DECISION_HISTOGRAM = "inference_extension_scheduler_e2e_duration_seconds"
PREDICTIONS = "prefix_epp_cached_tokens_predictions_total"
PREDICTED_WITHIN = "prefix_epp_cached_tokens_predicted_within_one_block_total"
PREDICTION_ERROR = "prefix_epp_cached_tokens_prediction_error_tokens"
PREFILL_S_PER_TOKEN = SimConfig().prefill_time_per_token / 1000


def hit_rate(results: Iterable[RequestResult]) -> float:
    prompt = cached = 0
    for r in results:
        if r.ok:
            prompt += r.prompt_tokens
            cached += r.cached_tokens
    return cached / prompt if prompt else 0.0


def prefill_work_s(results: Iterable[RequestResult], s_per_token: float = PREFILL_S_PER_TOKEN) -> float:
    return sum(r.prompt_tokens - r.cached_tokens for r in results if r.ok) * s_per_token


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """q in [0, 1]; buckets: (upper bound, cumulative count) in increasing order, the last +Inf."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for i, (bound, cumulative) in enumerate(buckets):
        if cumulative >= rank and cumulative > prev_count:
            if math.isinf(bound):
                return buckets[i - 1][0] if i else math.nan
            lower = prev_bound if i else min(0.0, bound)
            return lower + (bound - lower) * (rank - prev_count) / (cumulative - prev_count)
        prev_bound, prev_count = bound, cumulative
    return buckets[-1][0]


def parse_histogram(text: bytes, name: str) -> list[tuple[float, float]]:
    """Cumulative buckets of histogram `name` from Prometheus text (all label sets summed)."""
    by_bound: dict[float, float] = {}
    for labels, value in samples(text, f"{name}_bucket".encode()):
        le = labels.get("le")
        if le is not None:
            bound = float(le)
            by_bound[bound] = by_bound.get(bound, 0.0) + value
    return sorted(by_bound.items())


def _by_scorer(text: bytes, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in samples(text, name.encode()):
        scorer = labels.get("scorer", "")
        out[scorer] = out.get(scorer, 0.0) + value
    return out


def prediction_accuracy(text: bytes) -> dict[str, dict[str, float]]:
    """Per scorer: predictions, within_one_block (share, NaN without predictions), mae_tokens."""
    total = _by_scorer(text, PREDICTIONS)
    within = _by_scorer(text, PREDICTED_WITHIN)
    err_sum = _by_scorer(text, f"{PREDICTION_ERROR}_sum")
    err_count = _by_scorer(text, f"{PREDICTION_ERROR}_count")
    out: dict[str, dict[str, float]] = {}
    for scorer in sorted(total):
        n = total[scorer]
        count = err_count.get(scorer, 0.0)
        out[scorer] = {
            "predictions": int(n),
            "within_one_block": round(within.get(scorer, 0.0) / n, 4) if n else math.nan,
            "mae_tokens": round(err_sum.get(scorer, 0.0) / count, 1) if count else math.nan,
        }
    return out


@dataclass(frozen=True)
class ReplicaLoad:
    counts: dict[str, int]

    @property
    def max(self) -> int:
        return max(self.counts.values(), default=0)

    @property
    def mean(self) -> float:
        return sum(self.counts.values()) / len(self.counts) if self.counts else 0.0

    @property
    def max_over_mean(self) -> float:
        return self.max / self.mean if self.mean else 0.0


def replica_load(served_by: Iterable[str], replicas: Sequence[str]) -> ReplicaLoad:
    """Requests per replica; replicas that served nothing count as 0."""
    counts = Counter(s for s in served_by if s)
    return ReplicaLoad({r: counts.get(r, 0) for r in replicas} | dict(counts))


def _ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1000, 1) if values else math.nan


def summarize(results: Sequence[RequestResult], wall_s: float, replicas: Sequence[str],
              picker_metrics: bytes | None = None) -> dict[str, Any]:
    """One router on one workload: the figures of the results table (times in ms)."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok]
    load = replica_load((r.served_by for r in ok), replicas)
    row: dict[str, Any] = {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "hit_rate": round(hit_rate(results), 4),
        "prefill_work_s": round(prefill_work_s(results), 1),
        "ttft_ms": {"p50": _ms(ttft, 50), "p90": _ms(ttft, 90), "p99": _ms(ttft, 99)},
        "e2e_ms": {"p50": _ms(e2e, 50), "p99": _ms(e2e, 99)},
        "output_tokens_per_s": round(sum(r.completion_tokens for r in ok) / wall_s, 1) if wall_s > 0 else 0.0,
        "requests_per_replica": load.counts,
        "replica_max": load.max,
        "replica_mean": round(load.mean, 2),
        "replica_max_over_mean": round(load.max_over_mean, 3),
        "start_lag_p99_ms": _ms([r.lag_s for r in results], 99),
        "wall_s": round(wall_s, 2),
    }
    if picker_metrics is not None:
        buckets = parse_histogram(picker_metrics, DECISION_HISTOGRAM)
        row["decision_ms"] = {f"p{q}": round(histogram_quantile(q / 100, buckets) * 1000, 3) for q in (50, 99)}
        accuracy = prediction_accuracy(picker_metrics)
        if accuracy:
            row["prediction"] = accuracy
    return row


@dataclass(frozen=True)
class Target:
    workload: str
    goal: str
    value: float
    bound: float
    met: bool

    @property
    def miss(self) -> str:
        """By how much the goal was missed, relative to its bound ('' when met)."""
        if self.met or not self.bound:
            return ""
        return f"{abs(self.value - self.bound) / self.bound:.0%}"


# Workloads where requests share prefixes (every one but no-reuse): hit rate goal against the oracle.
REUSE_WORKLOADS = ("shared-prefix", "multi-turn", "hot-prefix", "cache-pressure", "mixed-length", "bursts")
# (workload, goal text, metric of the candidate, comparison, bound from: oracle | constant | another router,
# factor). Checked on the means over the repetitions; the candidate is prefix-epp (default scheduler).
TARGETS: tuple[tuple[str, str, str, str, str, float], ...] = (
    ("hot-prefix", "TTFT p99 <= 0.8x sglang-router", "ttft_ms.p99", "<=", "sglang-router", 0.8),
    ("bursts", "TTFT p99 <= 0.8x sglang-router", "ttft_ms.p99", "<=", "sglang-router", 0.8),
    ("shared-prefix", "TTFT p99 <= sglang-router", "ttft_ms.p99", "<=", "sglang-router", 1.0),
    ("multi-turn", "TTFT p99 <= sglang-router", "ttft_ms.p99", "<=", "sglang-router", 1.0),
    ("cache-pressure", "hit rate >= sglang-router", "hit_rate", ">=", "sglang-router", 1.0),
    ("cache-pressure", "TTFT p90 <= sglang-router", "ttft_ms.p90", "<=", "sglang-router", 1.0),
    ("mixed-length", "TTFT p99 < prefix-epp-weighted", "ttft_ms.p99", "<", "prefix-epp-weighted", 1.0),
    *((w, "hit rate >= 95% of oracle", "hit_rate", ">=", "oracle", 0.95) for w in REUSE_WORKLOADS),
)
# The same, for the precise scorer (candidate prefix-epp-precise, reference the approximate prefix-epp).
PRECISE_TARGETS: tuple[tuple[str, str, str, str, str, float], ...] = (
    ("cache-pressure", "TTFT p90 <= 1/2 of prefix-epp", "ttft_ms.p90", "<=", "prefix-epp", 0.5),
    ("cache-pressure", "precise within one block >= 95%", "prediction.precise.within_one_block", ">=",
     "constant", 0.95),
    ("shared-prefix", "precise within one block >= 95%", "prediction.precise.within_one_block", ">=",
     "constant", 0.95),
)


def _get(row: Mapping[str, Any], path: str) -> float:
    value: Any = row
    for key in path.split("."):
        value = value[key]
    return float(value)


def relative_to(summaries: Mapping[str, Mapping[str, Mapping[str, Any]]],
                reference: str = "clairvoyant") -> dict[str, dict[str, dict[str, float]]]:
    """[workload][router] -> hit rate and TTFT p99 as a fraction of `reference`'s (workloads it ran)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for workload, rows in summaries.items():
        ref = rows.get(reference)
        if ref is None:
            continue
        for router, r in rows.items():
            hit = r["hit_rate"] / ref["hit_rate"] if ref["hit_rate"] else math.nan
            p99 = r["ttft_ms"]["p99"] / ref["ttft_ms"]["p99"] if ref["ttft_ms"]["p99"] else math.nan
            out.setdefault(workload, {})[router] = {"hit_rate": hit, "ttft_p99": p99}
    return out


def evaluate_targets(summaries: Mapping[str, Mapping[str, Mapping[str, Any]]], oracle: Mapping[str, float],
                     candidate: str = "prefix-epp") -> list[Target]:
    """Check TARGETS for `candidate`; summaries[workload][router] are `summarize` rows.

    A goal whose workload, candidate or reference router was not run is left out. Candidates
    named prefix-epp-precise... are checked against PRECISE_TARGETS instead.
    """
    out: list[Target] = []
    goals = PRECISE_TARGETS if candidate.startswith("prefix-epp-precise") else TARGETS
    for workload, goal, metric, op, reference, factor in goals:
        rows = summaries.get(workload, {})
        if candidate not in rows:
            continue
        if reference == "oracle":
            if workload not in oracle:
                continue
            base = oracle[workload]
        elif reference == "constant":
            base = 1.0
        elif reference == candidate:
            continue  # prefix-epp-weighted is not measured against itself
        elif reference in rows:
            base = _get(rows[reference], metric)
        else:
            continue
        try:
            value = _get(rows[candidate], metric)
        except KeyError:
            continue
        bound = base * factor
        met = {">=": value >= bound, "<=": value <= bound, "<": value < bound}[op]
        out.append(Target(workload, goal, value, round(bound, 4), met))
    return out
