"""bench.lib.stats and bench.lib.targets: percentiles, hit rate, histogram quantiles, per-replica load,
summaries, targets."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bench.lib.client import RequestResult
from bench.lib.stats import (
    histogram_quantile,
    hit_rate,
    paired_ratio,
    parse_histogram,
    percentile,
    prediction_accuracy,
    prefill_work_s,
    replica_load,
    summarize,
    t975,
    verdict,
)
from bench.lib.targets import evaluate_targets, relative_to


def req(ttft: float | None = 0.1, e2e: float = 1.0, prompt: int = 100, cached: int = 0, served: str = "a",
        status: int = 200, error: str = "", completion: int = 10) -> RequestResult:
    return RequestResult(0, 0, "x", 0.0, 0.0, status, ttft, e2e, prompt, cached, completion, served, error)


def test_percentile_is_nearest_rank() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert [percentile(values, q) for q in (0, 50, 100)] == [1.0, 3.0, 5.0]
    assert percentile([float(i) for i in range(1, 102)], 99) == 100.0
    assert math.isnan(percentile([], 50))


def test_hit_rate_counts_only_successful_requests() -> None:
    results = [req(prompt=100, cached=50), req(prompt=300, cached=250), req(prompt=1000, cached=0, status=500)]
    assert hit_rate(results) == pytest.approx(300 / 400)
    assert hit_rate([]) == 0.0
    assert hit_rate([req(prompt=100, cached=100, error="stream ended without usage")]) == 0.0


def test_prefill_work_is_uncached_tokens_times_cost() -> None:
    assert prefill_work_s([req(prompt=1000, cached=400), req(prompt=50, cached=0)], 0.001) == pytest.approx(0.65)


BUCKETS = [(0.1, 10.0), (0.2, 30.0), (0.4, 40.0), (math.inf, 40.0)]


@pytest.mark.parametrize(("q", "expected"), [
    (0.125, 0.05),  # rank 5: halfway through the 10 of (0, 0.1]
    (0.25, 0.1),  # rank 10: the top of (0, 0.1]
    (0.5, 0.15),  # rank 20: 10 into the 20 of (0.1, 0.2]
    (0.9, 0.32),  # rank 36: 6 into the 10 of (0.2, 0.4]
])
def test_histogram_quantile_interpolates_within_the_bucket(q: float, expected: float) -> None:
    assert histogram_quantile(q, BUCKETS) == pytest.approx(expected)


def test_histogram_quantile_first_bucket_starts_at_zero() -> None:
    assert histogram_quantile(0.25, [(0.1, 20.0), (math.inf, 20.0)]) == pytest.approx(0.025)


def test_histogram_quantile_in_the_inf_bucket_returns_the_highest_finite_bound() -> None:
    assert histogram_quantile(0.99, [(0.1, 5.0), (0.5, 8.0), (math.inf, 10.0)]) == 0.5


def test_histogram_quantile_of_nothing_is_nan() -> None:
    assert math.isnan(histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]))
    assert math.isnan(histogram_quantile(0.5, []))


def test_parse_histogram_reads_cumulative_buckets() -> None:
    text = b"""# HELP h Decision latency
# TYPE h histogram
h_bucket{le="0.001"} 3.0
h_bucket{le="0.01"} 7.0
h_bucket{le="+Inf"} 8.0
h_count 8.0
h_sum 0.02
other_bucket{le="0.001"} 99.0
"""
    buckets = parse_histogram(text, "h")
    assert buckets == [(0.001, 3.0), (0.01, 7.0), (math.inf, 8.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.001 + 0.009 * (4 - 3) / 4)


def test_replica_load_lists_idle_replicas_as_zero() -> None:
    load = replica_load(["a", "a", "a", "b", ""], ["a", "b", "c"])
    assert load.counts == {"a": 3, "b": 1, "c": 0}
    assert load.max == 3 and load.mean == pytest.approx(4 / 3)
    assert load.max_over_mean == pytest.approx(2.25)
    assert replica_load([], []).max_over_mean == 0.0


def test_summarize_reports_errors_latencies_and_load() -> None:
    results = [req(ttft=t / 1000, e2e=t / 100, cached=50, served=s) for t, s in zip(range(1, 101), "ab" * 50,
                                                                                  strict=True)]
    results.append(req(status=503, served="a"))
    row = summarize(results, wall_s=10.0, replicas=["a", "b", "c"])
    assert row["requests"] == 101 and row["errors"] == 1
    assert row["hit_rate"] == 0.5
    assert row["ttft_ms"]["p50"] == pytest.approx(51.0) and row["ttft_ms"]["p99"] == pytest.approx(99.0)
    assert row["e2e_ms"]["p50"] == pytest.approx(510.0)
    assert row["output_tokens_per_s"] == 100.0  # 100 ok requests x 10 tokens / 10 s
    assert row["requests_per_replica"] == {"a": 50, "b": 50, "c": 0}
    assert row["replica_max_over_mean"] == pytest.approx(1.5)
    assert "decision_ms" not in row


def test_summarize_reads_the_picker_decision_histogram() -> None:
    text = (b'inference_extension_scheduler_e2e_duration_seconds_bucket{le="0.0005"} 50.0\n'
            b'inference_extension_scheduler_e2e_duration_seconds_bucket{le="0.001"} 100.0\n'
            b'inference_extension_scheduler_e2e_duration_seconds_bucket{le="+Inf"} 100.0\n')
    row = summarize([req()], 1.0, ["a"], picker_metrics=text)
    assert row["decision_ms"] == {"p50": 0.5, "p99": pytest.approx(0.99)}


def row(hit: float = 0.5, p50: float = 100.0, p90: float = 500.0, p99: float = 1000.0,
        max_over_mean: float = 1.0) -> dict[str, Any]:
    return {"hit_rate": hit, "ttft_ms": {"p50": p50, "p90": p90, "p99": p99}, "replica_max_over_mean": max_over_mean}


def test_targets_met_and_missed() -> None:
    summaries = {
        "shared-prefix": {"prefix-epp": row(hit=0.6, p99=900), "sglang-router": row(p99=800)},
        "hot-prefix": {"prefix-epp": row(p99=790), "sglang-router": row(p99=1000)},
        "bursts": {"prefix-epp": row(p99=850), "sglang-router": row(p99=1000)},
        "cache-pressure": {"prefix-epp": row(hit=0.5, p90=400), "sglang-router": row(hit=0.45, p90=450)},
        "mixed-length": {"prefix-epp": row(p99=1000), "prefix-epp-weighted": row(p99=1000)},
        "no-reuse": {"prefix-epp": row(p99=1050), "least-request": row(p99=1000)},
    }
    oracle = {"shared-prefix": 0.64, "no-reuse": 0.0, "mixed-length": 0.5}
    targets = {(t.workload, t.goal): t for t in evaluate_targets(summaries, oracle)}
    # multi-turn was not run; no-reuse has no goal; oracle bounds only where the oracle is known
    assert len(targets) == 8
    hit = targets[("shared-prefix", "hit rate >= 95% of oracle")]
    assert not hit.met and hit.bound == pytest.approx(0.608)  # 0.6 < 0.95 x 0.64
    assert targets[("mixed-length", "hit rate >= 95% of oracle")].met  # 0.5 >= 0.475
    p99 = targets[("shared-prefix", "TTFT p99 <= sglang-router")]
    assert not p99.met and p99.miss == "12%"  # 900 vs 800
    assert targets[("hot-prefix", "TTFT p99 <= 0.8x sglang-router")].met  # 790 <= 800
    bursts = targets[("bursts", "TTFT p99 <= 0.8x sglang-router")]
    assert not bursts.met and bursts.bound == 800.0
    assert targets[("cache-pressure", "hit rate >= sglang-router")].met
    assert targets[("cache-pressure", "TTFT p90 <= sglang-router")].met  # 400 <= 450
    assert not targets[("mixed-length", "TTFT p99 < prefix-epp-weighted")].met  # a tie is not better
    # The weighted profile is not measured against itself.
    weighted = evaluate_targets(summaries, oracle, candidate="prefix-epp-weighted")
    assert [t.goal for t in weighted] == ["hit rate >= 95% of oracle"]
    assert evaluate_targets(summaries, {}, candidate="nobody") == []


def test_every_router_relative_to_the_clairvoyant() -> None:
    summaries = {"bursts": {"clairvoyant": row(hit=0.8, p99=500), "round-robin": row(hit=0.4, p99=2000)},
                 "no-reuse": {"round-robin": row()}}
    rel = relative_to(summaries)
    assert rel == {"bursts": {"clairvoyant": {"hit_rate": 1.0, "ttft_p99": 1.0},
                              "round-robin": {"hit_rate": 0.5, "ttft_p99": 4.0}}}


PICKER_CLOSED_LOOP = (
    b'# TYPE prefix_epp_cached_tokens_predictions_total counter\n'
    b'prefix_epp_cached_tokens_predictions_total{scorer="approximate"} 200.0\n'
    b'prefix_epp_cached_tokens_predictions_total{scorer="precise"} 200.0\n'
    b'prefix_epp_cached_tokens_predicted_within_one_block_total{scorer="approximate"} 120.0\n'
    b'prefix_epp_cached_tokens_predicted_within_one_block_total{scorer="precise"} 194.0\n'
    b'prefix_epp_cached_tokens_prediction_error_tokens_bucket{le="16.0",scorer="precise"} 194.0\n'
    b'prefix_epp_cached_tokens_prediction_error_tokens_bucket{le="+Inf",scorer="precise"} 200.0\n'
    b'prefix_epp_cached_tokens_prediction_error_tokens_count{scorer="approximate"} 200.0\n'
    b'prefix_epp_cached_tokens_prediction_error_tokens_sum{scorer="approximate"} 240000.0\n'
    b'prefix_epp_cached_tokens_prediction_error_tokens_count{scorer="precise"} 200.0\n'
    b'prefix_epp_cached_tokens_prediction_error_tokens_sum{scorer="precise"} 3200.0\n'
)


def test_prediction_accuracy_from_the_picker_counters() -> None:
    acc = prediction_accuracy(PICKER_CLOSED_LOOP)
    assert acc == {"approximate": {"predictions": 200, "within_one_block": 0.6, "mae_tokens": 1200.0},
                   "precise": {"predictions": 200, "within_one_block": 0.97, "mae_tokens": 16.0}}
    # within-one-block counter not exported yet (no prediction within a block so far): 0, not missing
    only_total = b'prefix_epp_cached_tokens_predictions_total{scorer="precise"} 3.0\n'
    assert prediction_accuracy(only_total)["precise"]["within_one_block"] == 0.0
    assert math.isnan(prediction_accuracy(only_total)["precise"]["mae_tokens"])
    assert prediction_accuracy(b"") == {}
    row = summarize([req()], 1.0, ["a"], picker_metrics=PICKER_CLOSED_LOOP)
    assert row["prediction"]["precise"]["within_one_block"] == 0.97
    assert "prediction" not in summarize([req()], 1.0, ["a"], picker_metrics=b"")


def test_precise_targets_compare_with_the_approximate_router() -> None:
    summaries: dict[str, dict[str, dict[str, Any]]] = {"cache-pressure": {
        "prefix-epp": {"ttft_ms": {"p90": 1000.0}},
        "prefix-epp-precise": {"ttft_ms": {"p90": 600.0},
                               "prediction": {"precise": {"within_one_block": 0.97}}}}}
    targets = {t.goal: t for t in evaluate_targets(summaries, {}, candidate="prefix-epp-precise")}
    p90 = targets["TTFT p90 <= 1/2 of prefix-epp"]
    assert not p90.met and p90.bound == 500.0 and p90.miss == "20%"
    assert targets["precise within one block >= 95%"].met
    assert len(targets) == 2  # shared-prefix was not run


def test_student_t_quantiles_are_the_tables_and_the_expansion_beyond() -> None:
    assert t975(1) == 12.706 and t975(4) == 2.776 and t975(30) == 2.042
    assert t975(60) == pytest.approx(2.000, abs=0.001)  # tables: 2.000 (60), 1.980 (120)
    assert t975(120) == pytest.approx(1.980, abs=0.001)
    assert t975(31) < t975(30)
    with pytest.raises(ValueError):
        t975(0)


def test_paired_ratio_of_two_repetitions_by_hand() -> None:
    # Ratios 2 and 4: log2 ratios 1 and 2, mean 1.5, sd 1/sqrt(2); half width t(1) sd / sqrt(2) = t(1) / 2.
    p = paired_ratio([2.0, 8.0], [1.0, 2.0])
    assert p.n == 2
    assert p.ratio == pytest.approx(2**1.5)
    assert p.low == pytest.approx(2 ** (1.5 - 12.706 / 2)) and p.high == pytest.approx(2 ** (1.5 + 12.706 / 2))
    assert not p.excludes_one and verdict(p, higher_is_better=False) == ""


def test_paired_ratio_of_three_repetitions_by_hand() -> None:
    # Ratios 2, 4, 8: log2 ratios 1, 2, 3, mean 2, sd 1; half width t(2) / sqrt(3) = 4.303 / 1.732 = 2.484.
    p = paired_ratio([2.0, 4.0, 8.0], [1.0, 1.0, 1.0])
    assert p.ratio == pytest.approx(4.0)
    assert p.low == pytest.approx(2 ** (2 - 4.303 / math.sqrt(3)))  # 0.715: the interval holds 1
    assert p.high == pytest.approx(2 ** (2 + 4.303 / math.sqrt(3)))  # 22.4
    assert not p.excludes_one


def test_a_steady_ratio_excludes_one_and_the_verdict_follows_the_direction() -> None:
    # Five repetitions, each arm 10% faster than the reference, give or take 1%.
    faster = paired_ratio([0.89, 0.90, 0.91, 0.90, 0.90], [1.0] * 5)
    logs = [math.log(r) for r in (0.89, 0.90, 0.91, 0.90, 0.90)]
    mean = sum(logs) / 5
    sd = math.sqrt(sum((v - mean) ** 2 for v in logs) / 4)
    assert faster.ratio == pytest.approx(math.exp(mean))
    assert faster.high == pytest.approx(math.exp(mean + 2.776 * sd / math.sqrt(5)))
    assert faster.high < 1.0
    assert verdict(faster, higher_is_better=False) == "better"  # a time: lower is better
    assert verdict(faster, higher_is_better=True) == "worse"  # a hit rate: higher is better
    same = paired_ratio([1.1, 1.1, 1.1], [1.0, 1.0, 1.0])  # no spread: the interval is the point
    assert same.low == pytest.approx(1.1) and same.high == pytest.approx(1.1)
    assert verdict(same, higher_is_better=True) == "better"


def test_pairs_without_a_positive_figure_are_left_out_and_one_pair_has_no_interval() -> None:
    p = paired_ratio([0.0, 2.0, math.nan], [0.0, 1.0, 1.0])  # 0/0 (no hits at all) and a missing figure
    assert p.n == 1 and p.ratio == pytest.approx(2.0)
    assert math.isnan(p.low) and math.isnan(p.high) and not p.excludes_one and verdict(p, True) == ""
    empty = paired_ratio([], [])
    assert empty.n == 0 and math.isnan(empty.ratio)
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])  # pairs, or nothing
