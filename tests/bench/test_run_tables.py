"""bench.run bookkeeping: per-process CPU from /proc, the note when a router could not run, and the
workload draws of --vary-seed."""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.lib.draws import Draw
from bench.lib.oracle import pooled_oracle
from bench.lib.report import write_results
from bench.lib.runner import process_cpu_s


def test_process_cpu_counts_this_process_and_ignores_gone_pids() -> None:
    before = process_cpu_s([os.getpid()])
    t0 = time.process_time()
    while time.process_time() - t0 < 0.2:
        pass
    after = process_cpu_s([os.getpid(), 2**22 + 12345])  # a pid that does not exist adds nothing
    assert after - before >= 0.1


def test_results_say_which_router_did_not_run_and_why(tmp_path: Path) -> None:
    config = {"replicas": 4, "time_scale": 1.0, "not_run": {"go-epp": "no Go toolchain"}}
    write_results(tmp_path, "t", config, {}, [], {}, [])
    assert "Not run: go-epp: no Go toolchain." in (tmp_path / "t.md").read_text()


def test_each_seed_draws_other_prompts_on_the_same_pool_and_the_oracle_pools_the_draws() -> None:
    first, second = (Draw.of(["cache-pressure"], seed, quick=True, load=1.0, replicas=4, time_scale=1.0)
                     for seed in (0, 1))
    a, b = first.workloads["cache-pressure"], second.workloads["cache-pressure"]
    assert [s.prompts for s in a.sessions] != [s.prompts for s in b.sessions]
    assert [s.start_s for s in a.sessions] != [s.start_s for s in b.sessions]
    # Same shape: same request count, and the pool sized alike from each draw's working set.
    assert a.requests == b.requests
    assert first.sims["cache-pressure"].kv_cache_blocks == second.sims["cache-pressure"].kv_cache_blocks
    pooled = pooled_oracle([first.oracle, second.oracle])["cache-pressure"]
    o1, o2 = first.oracle["cache-pressure"], second.oracle["cache-pressure"]
    assert pooled.prompt_tokens == o1.prompt_tokens + o2.prompt_tokens
    assert pooled.hit_rate == (o1.cached_tokens + o2.cached_tokens) / (o1.prompt_tokens + o2.prompt_tokens)
