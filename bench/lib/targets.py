"""The benchmark's goals, checked on the summary rows (`bench.lib.stats.summarize`) of a run.

- `TARGETS`: the goals of the default candidate, prefix-epp: a TTFT p99 at most 0.8x
  sglang-router's on hot-prefix and bursts and at most sglang-router's on shared-prefix and
  multi-turn; on cache-pressure a hit rate at least and a TTFT p90 at most sglang-router's; on
  mixed-length a TTFT p99 below prefix-epp-weighted's; and a hit rate of at least 95% of the
  oracle on every workload that reuses prefixes.
- `PRECISE_TARGETS`: the goals of prefix-epp-precise: TTFT p90 at most half the approximate
  prefix-epp's on cache-pressure, and at least 95% of its predictions within one block on
  cache-pressure and shared-prefix.
- `evaluate_targets(summaries, oracle, candidate)`: those goals met or missed (`Target`);
  `bench.run` passes the means over the repetitions.
- `relative_to(summaries)`: every router's hit rate and TTFT p99 as a fraction of the
  clairvoyant reference's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


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
