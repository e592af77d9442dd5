"""Smoke test of the demo pipeline end to end: real Envoy, picker, simulated replicas, both routers.

Reduced form: 2 replicas, 20 requests (4 groups x 5 sharing a system prompt), random vs prefix-epp.
"""

from __future__ import annotations

import pytest

from bench.demo import demo
from bench.lib.workloads import SharedPrefixParams

pytestmark = pytest.mark.e2e

SMOKE = SharedPrefixParams(groups=4, per_group=5, system_tokens=800, question_tokens=80, max_tokens=8, rate=5.0)


def test_demo_pipeline_end_to_end() -> None:
    lines: list[str] = []
    result = demo(SMOKE, replicas=2, log=lines.append)  # its duration is a README figure, not a test
    assert list(result.rows) == ["random", "prefix-epp"]
    for router, row in result.rows.items():
        assert row["requests"] == 20 and row["errors"] == 0, router
        assert sum(row["requests_per_replica"].values()) == 20 and len(row["requests_per_replica"]) == 2
        assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"] <= row["e2e_ms"]["p99"]
        assert 0.0 <= row["hit_rate"] <= result.oracle_hit_rate + 1e-4  # rounded to 4 digits
    random_hits, epp_hits = result.rows["random"]["hit_rate"], result.rows["prefix-epp"]["hit_rate"]
    assert epp_hits > random_hits
    assert epp_hits >= 0.8 * result.oracle_hit_rate
    assert result.rows["prefix-epp"]["decision_ms"]["p50"] > 0
    table = result.table()
    assert "| prefix-epp |" in table and "| random |" in table
    assert any("[prefix-epp] sending 20 requests" in line for line in lines)
