"""A benchmark run's summary row as bench.run writes it, with chosen figures (the aggregation and
report tests build repetitions from it)."""

from __future__ import annotations

from typing import Any


def summary(hit: float, p99: float, counts: dict[str, int], decision: float | None = None) -> dict[str, Any]:
    """One router's row on one workload: hit rate `hit`, TTFT p99 `p99` (p50 and p90 derived),
    requests per replica `counts`, and the decision latency p50 when given."""
    row: dict[str, Any] = {
        "requests": 10, "errors": 0, "hit_rate": hit, "prefill_work_s": 1.0,
        "ttft_ms": {"p50": p99 / 4, "p90": p99 / 2, "p99": p99}, "e2e_ms": {"p50": 2 * p99, "p99": 3 * p99},
        "output_tokens_per_s": 100.0, "requests_per_replica": counts, "replica_max": max(counts.values()),
        "replica_mean": sum(counts.values()) / len(counts),
        "replica_max_over_mean": max(counts.values()) / (sum(counts.values()) / len(counts)),
        "router_cpu_ms_per_request": 1.5, "cpu_busy": 0.5, "start_lag_p99_ms": 1.0, "wall_s": 10.0}
    if decision is not None:
        row["decision_ms"] = {"p50": decision, "p99": 2 * decision}
    return row
