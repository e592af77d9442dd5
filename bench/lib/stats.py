"""The benchmark's arithmetic: pure functions from measured requests to the reported figures.

- `percentile(values, q)`: nearest rank, q in percent (NaN for no values).
- `spread(values)`: mean, min and max of the repetitions' values (NaN ones left out; all NaN
  when none is left).
- `paired_ratio(values, reference)`: the paired comparison of one arm with the reference arm
  over repetitions (module section below); `t975(df)` the Student-t quantile it uses;
  `verdict(p, higher_is_better)` the claim it allows.
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
- `summarize`: one router on one workload -> the row of the results table, with the TTFT's mean
  (`ttft_ms_mean`), which the engines' own mean is compared with.
- `gateway_figures(log)`: from an Envoy setup's access log (bench.lib.routers.ACCESS_LOG_FORMAT),
  the mean, p50 and p99 of Envoy's time from a request's first byte to its upstream request: what
  the gateway and its picker add before an engine sees the request.
- `with_engine_load(row, engine_hit_rate, engine_requests, **engine_means)`: a real-vLLM row
  (bench.lib.vllm_backend) with the engines' own hit rate beside the usage-based one (and their
  mean TTFT and queue time), and, when no response named the replica
  that served it (`requests_per_replica` empty but for idle replicas), the load-balance columns from the
  engines' finished-request counters instead.

The goals checked against those rows live in `bench.lib.targets`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.lib.client import RequestResult
from extproc.scraping.prom_text import samples
from prefix_epp_sim.config import SimConfig

DECISION_HISTOGRAM = "inference_extension_scheduler_e2e_duration_seconds"
PREDICTIONS = "prefix_epp_cached_tokens_predictions_total"
PREDICTED_WITHIN = "prefix_epp_cached_tokens_predicted_within_one_block_total"
PREDICTION_ERROR = "prefix_epp_cached_tokens_prediction_error_tokens"
PREFILL_S_PER_TOKEN = SimConfig().prefill_time_per_token / 1000


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]



def spread(values: Sequence[float]) -> dict[str, float]:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return {"mean": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"mean": sum(finite) / len(finite), "min": min(finite), "max": max(finite)}

# --- paired ratios ----------------------------------------------------------------------------
#
# Arm X and the reference arm R run the same workload draw in the same repetition (interleaved:
# bench.run), so repetition k gives one pair (x_k, r_k) of a figure (TTFT p99, hit rate, ...).
# The comparison is on the per-repetition LOG ratios l_k = ln(x_k / r_k): machine drift that
# scales both arms of a repetition cancels, and a ratio and its inverse are symmetric. With n
# pairs, mean m and sample standard deviation s of the l_k, the 95% interval is
# exp(m -/+ t975(n - 1) x s / sqrt(n)) (Student t, n - 1 degrees of freedom) around exp(m), the
# geometric mean of the ratios. A pair with a value that is not a positive finite number (a hit
# rate of 0, a figure a setup does not have) has no log ratio and is left out (n says how many
# pairs counted); under 2 pairs there is no interval (NaN bounds). An arm is "better" or "worse"
# only where the interval excludes 1 (`verdict`).

# Two-sided 95% Student-t quantiles (the 0.975 quantile) for 1-30 degrees of freedom.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
Z975 = 1.959964


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom: the table up to 30, then
    the Cornish-Fisher expansion around the normal quantile (within 0.001 of the exact value)."""
    if df < 1:
        raise ValueError("Student's t needs at least 1 degree of freedom")
    if df <= len(T975):
        return T975[df - 1]
    z = Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class PairedRatio:
    """One arm against the reference over the repetitions (the section above)."""

    n: int  # pairs that counted
    ratio: float  # geometric mean of the per-repetition ratios arm / reference
    low: float  # the 95% interval of the ratio (NaN under 2 pairs)
    high: float

    @property
    def excludes_one(self) -> bool:
        return self.low > 1.0 or self.high < 1.0  # False when NaN


def _usable(x: float, r: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in (x, r))


def paired_ratio(values: Sequence[float], reference: Sequence[float]) -> PairedRatio:
    """values[k] / reference[k] over the repetitions k: the geometric mean ratio and its 95%
    Student-t interval on the log ratios (the section above)."""
    logs = [math.log(x / r) for x, r in zip(values, reference, strict=True) if _usable(x, r)]
    n = len(logs)
    if not n:
        return PairedRatio(0, math.nan, math.nan, math.nan)
    mean = math.fsum(logs) / n
    if n < 2:
        return PairedRatio(1, math.exp(mean), math.nan, math.nan)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in logs) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return PairedRatio(n, math.exp(mean), math.exp(mean - half), math.exp(mean + half))


def verdict(p: PairedRatio, higher_is_better: bool) -> str:
    """'better' or 'worse' where the interval excludes 1 (higher_is_better: hit rates; else
    times), else '' (no claim)."""
    if not p.excludes_one:
        return ""
    return "better" if (p.low > 1.0) == higher_is_better else "worse"


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
        "ttft_ms_mean": round(1000 * sum(ttft) / len(ttft), 1) if ttft else math.nan,
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


def gateway_figures(log: str) -> dict[str, float]:
    """{mean, p50, p99} in ms of the first field (microseconds) of each access-log line; {} for none."""
    us = [float(line.split()[0]) for line in log.splitlines() if line[:1].isdigit()]
    if not us:
        return {}
    return {"mean": round(sum(us) / len(us) / 1000, 2), "p50": round(percentile(us, 50) / 1000, 2),
            "p99": round(percentile(us, 99) / 1000, 2)}


def with_engine_load(row: dict[str, Any], engine_hit_rate: float, engine_requests: dict[str, int],
                     **engine_means: float) -> dict[str, Any]:
    """`row` plus the engines' own figures (module docstring); the row itself is not changed."""
    out = {**row, "engine_hit_rate": engine_hit_rate, "engine_requests": dict(engine_requests), **engine_means}
    if not any(row["requests_per_replica"].values()):
        load = ReplicaLoad(dict(engine_requests))
        out |= {"requests_per_replica": load.counts, "replica_max": load.max, "replica_mean": round(load.mean, 2),
                "replica_max_over_mean": round(load.max_over_mean, 3), "load_from": "engine counters"}
    return out
