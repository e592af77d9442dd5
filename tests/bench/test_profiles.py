"""Simulator profiles (bench/lib/profiles.py) and the regimes table (bench/regimes.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.lib.profiles import PROFILES, settings, smaller_replicas
from bench.lib.routers import SimSettings
from bench.lib.workloads import WORKLOADS, build
from bench.regimes import table
from prefix_epp_sim.cli import build_parser, config_from_args


@pytest.mark.parametrize("name", WORKLOADS)
def test_a_profile_output_length_replaces_every_request_s(name: str) -> None:
    decode_bound = PROFILES["decode-bound"]
    long = build(name, quick=True, max_tokens=decode_bound.max_tokens)
    default = build(name, quick=True)
    assert {s.max_tokens for s in long.sessions} == {128}
    assert [s.prompts for s in long.sessions] == [s.prompts for s in default.sessions]  # the same draw


def test_profile_flags_reach_the_simulator() -> None:
    base = SimSettings(replicas=4, kv_cache_blocks=5000, sim_args=("--tokenizer", "t.json"))
    for profile in PROFILES.values():
        sim = settings(profile, base)
        assert sim.sim_args[:2] == ("--tokenizer", "t.json") and sim.max_num_seqs == profile.max_num_seqs
        args = ["--replicas", "4", "--max-num-seqs", str(sim.max_num_seqs), *sim.sim_args[2:]]
        config = config_from_args(build_parser().parse_args(args))
        assert config.max_num_seqs == profile.max_num_seqs
    hetero = config_from_args(build_parser().parse_args(["--replicas", "4", *PROFILES["heterogeneous"].sim_args]))
    assert [hetero.for_replica(i).prefill_time_per_token for i in range(4)] == pytest.approx([0.06] * 3 + [0.24])
    minimal = config_from_args(build_parser().parse_args(list(PROFILES["minimal-metrics"].sim_args)))
    assert minimal.metrics_surface == "minimal"


def test_smaller_replicas_make_every_replica_pay_every_cost() -> None:
    base = SimSettings(replicas=16, kv_cache_blocks=500)
    assert smaller_replicas(base, 1) == base
    sim = smaller_replicas(base, 4)
    config = config_from_args(build_parser().parse_args(["--replicas", "16", *sim.sim_args]))
    default = config_from_args(build_parser().parse_args(["--replicas", "16"]))
    for i in (0, 15):
        assert config.for_replica(i).prefill_time_per_token == pytest.approx(4 * default.prefill_time_per_token)
        assert config.for_replica(i).decode_time_per_seq == pytest.approx(4 * default.decode_time_per_seq)


def _summary(p99: float, load: float = 1.2, hit: float = 0.7) -> dict[str, object]:
    return {"ttft_ms": {"p99": p99}, "replica_max_over_mean": load, "hit_rate": hit}


def test_the_table_checks_the_targets_on_the_means(tmp_path: Path) -> None:
    results = {"hot-prefix": {"prefix-epp": _summary(700, load=1.6), "prefix-epp-weighted": _summary(800),
                              "sglang-router": _summary(1000), "clairvoyant": _summary(600)},
               "bursts": {"prefix-epp": _summary(900), "sglang-router": _summary(400),
                          "clairvoyant": _summary(1000, hit=0.72)}}
    data = {"config": {"repeat": 3}, "results": results, "spread": {},
            "oracle": {"hot-prefix": {"hit_rate": 0.72}, "bursts": {"hit_rate": 0.8}}}
    (tmp_path / "bench-regimes-decode-bound.json").write_text(json.dumps(data))
    text = table(tmp_path).read_text()
    hot = next(line for line in text.splitlines() if "| hot-prefix |" in line)
    assert "700 (700-700)" in hot and "p99 x0.70 of sglang-router (<= 0.8): yes" in hot
    assert "busiest/mean <= 1.5: no" in hot and "hit >= 95% of oracle: yes" in hot and "(x0.88)" in hot
    bursts = next(line for line in text.splitlines() if "| bursts |" in line)
    assert "p99 x2.25 of sglang-router (<= 0.8): no" in bursts
    assert "p99 x0.90 of clairvoyant" in bursts and "busiest" not in bursts  # a burst may warm replicas
    # 0.70 < 95% of the oracle's 0.80, but a burst is judged on the clairvoyant router's hit rate
    assert "hit >= 95% of clairvoyant's: yes (72.0%)" in bursts and "oracle" not in bursts
