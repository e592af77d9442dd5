"""The `go-epp` benchmark setup end to end: the Go endpoint picker (GIE v1.5.0, built by
bench/peers/build.sh), a real kube-apiserver holding its pool, real Envoy, simulated replicas.

Reduced form: 2 replicas, 20 requests (4 groups x 5 sharing a system prompt). The Go picker's
default profile weighs the prefix scorer 3 against 2 + 2 for load, so most of a group's requests
reuse the replica that cached its system prompt.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from bench.lib.oracle import workload_oracle
from bench.lib.runner import RouterSpec, run_one, sim_settings
from bench.lib.tables import results_table
from bench.lib.workloads import SharedPrefixParams, shared_prefix

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]  # the first run builds the binaries

SMOKE = SharedPrefixParams(groups=4, per_group=5, system_tokens=800, question_tokens=80, max_tokens=8, rate=5.0)


def test_go_epp_routes_through_envoy_with_prefix_affinity() -> None:
    workload = shared_prefix(SMOKE)
    oracle = workload_oracle(workload)
    sim = sim_settings(oracle, 2, 1.0)
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="prefix-epp-go-epp-") as tmp:
        row = run_one(Path(tmp), workload, RouterSpec("go-epp"), sim, lines.append).summary
    assert row["requests"] == 20 and row["errors"] == 0
    assert sum(row["requests_per_replica"].values()) == 20 and len(row["requests_per_replica"]) == 2
    assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"]
    assert row["hit_rate"] >= 0.5 * oracle.hit_rate  # prefix affinity at work (random gets about half)
    assert row["decision_ms"]["p99"] > 0  # read from the Go picker's own scheduler histogram
    assert row["router_cpu_s"] > 0
    assert "| go-epp |" in results_table({"smoke": {"go-epp": row}}, {"smoke": oracle.hit_rate})
