"""The `llm-d` and `llm-d-precise` benchmark setups: llm-d's router (LLMD_EPP), a real kube-apiserver
holding its pool, real Envoy, simulated replicas.

The configuration and discovery checks run everywhere. The end-to-end ones need the binary,
which is built outside the repository (bench/lib/llmd.py): without `LLMD_EPP` they skip, and the
benchmark reports the setups as not run. Reduced form: 2 replicas, 20 requests (4 groups x 5).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from bench.lib import llmd
from bench.lib.oracle import workload_oracle
from bench.lib.routers import PUBLISHING_ROUTERS
from bench.lib.runner import RouterSpec, run_one, sim_settings
from bench.lib.workloads import SharedPrefixParams, shared_prefix

SMOKE = SharedPrefixParams(groups=4, per_group=5, system_tokens=800, question_tokens=80, max_tokens=8, rate=5.0)
needs_binary = pytest.mark.skipif(bool(llmd.unavailable()), reason="LLMD_EPP names no llm-d router binary")


def test_unavailable_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(llmd.ENV, raising=False)
    assert "LLMD_EPP is not set" in llmd.unavailable()
    monkeypatch.setenv(llmd.ENV, str(tmp_path / "missing"))
    assert "is not an executable file" in llmd.unavailable()


def test_kv_event_ports_are_the_rank_offsets_llmd_dials() -> None:
    spec = [f"tcp://127.0.0.1:{7000 + i}@tcp://127.0.0.1:{7100 + i}" for i in range(3)]
    assert llmd.ports_of(spec) == (7000, 7100)
    with pytest.raises(ValueError, match="consecutive"):
        llmd.ports_of([spec[0], "tcp://127.0.0.1:7005@tcp://127.0.0.1:7101"])


def test_precise_config_feeds_every_prefix_consumer_from_the_kv_event_index() -> None:
    cfg = llmd.precise_config("http://127.0.0.1:9000", 7000, 7100, 16)
    plugins = {p["type"]: p.get("parameters", {}) for p in cfg["plugins"]}
    producer = plugins["precise-prefix-cache-producer"]
    assert producer["kvEventsConfig"]["podDiscoveryConfig"] == {"socketPort": 7000, "replaySocketPort": 7100}
    assert producer["kvEventsConfig"]["topicFilter"] == "kv@" and producer["kvEventsConfig"]["discoverPods"]
    assert producer["tokenProcessorConfig"]["blockSizeTokens"] == 16
    assert plugins["token-producer"] == {"modelName": "sim-model", "vllm": {"url": "http://127.0.0.1:9000"}}
    # A consumer that names no producer would read an approximate one llm-d spawns by itself.
    for consumer in ("prefix-cache-scorer", "prefix-cache-affinity-filter", "inflight-load-producer"):
        assert plugins[consumer]["prefixMatchInfoProducerName"] == "precise-prefix-cache-producer"
    profile = [p["pluginRef"] for p in cfg["schedulingProfiles"][0]["plugins"]]
    assert profile[0] == "prefix-cache-affinity-filter" and "token-load-scorer" in profile
    assert "queue-scorer" not in profile and "llm-d-precise" in PUBLISHING_ROUTERS and "llm-d" not in PUBLISHING_ROUTERS


@pytest.mark.e2e
@pytest.mark.timeout(300)
@needs_binary
@pytest.mark.parametrize("setup", llmd.SETUPS)
def test_llmd_routes_through_envoy_with_prefix_affinity(setup: str) -> None:
    workload = shared_prefix(SMOKE)
    oracle = workload_oracle(workload)
    sim = sim_settings(oracle, 2, 1.0)
    with tempfile.TemporaryDirectory(prefix=f"prefix-epp-{setup}-") as tmp:
        row = run_one(Path(tmp), workload, RouterSpec(setup), sim).summary
    assert row["requests"] == 20 and row["errors"] == 0
    assert sum(row["requests_per_replica"].values()) == 20 and len(row["requests_per_replica"]) == 2
    assert row["hit_rate"] >= 0.5 * oracle.hit_rate  # prefix affinity at work (random gets about half)
    assert row["router_cpu_s"] > 0
