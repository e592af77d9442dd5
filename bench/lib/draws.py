"""The workloads of one benchmark draw (one seed), with what every run of them needs.

`Draw.of(names, seed, ...)`: the named workloads drawn with `seed` (`bench.lib.workloads.build`,
or `bench.lib.vllm_workloads.build_vllm` for the vLLM backends), each one's infinite-cache oracle
and per-request block traces (`bench.lib.oracle.traced_oracle`; at vLLM's block size over the tiny
model's real token ids for the vLLM backends), and the replicas' settings: on the simulator the
KV cache sized from the oracle's working set (`bench.lib.runner.sim_settings`) and the replica
model (`bench.lib.profiles`); on the vLLM backends the engines' (with a workload's own sequence
slots, `bench.lib.vllm_workloads.max_num_seqs`). bench.run draws once per seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from bench.lib import sim_vllm, vllm_backend
from bench.lib.cache_bound import BlockTrace
from bench.lib.oracle import VLLM_BLOCK_SIZE, OracleResult, traced_oracle, vllm_answer, vllm_tokens
from bench.lib.profiles import PROFILES, SimProfile, smaller_replicas
from bench.lib.profiles import settings as profile_settings
from bench.lib.routers import SimSettings
from bench.lib.runner import sim_settings
from bench.lib.vllm_workloads import build_vllm, max_num_seqs
from bench.lib.workloads import Workload, build
from extproc.tokenization.tokenizer_json import HFTokenizer
from testkit.vllm import NUM_BLOCKS
from testkit.vllm_env import ensure


@dataclass(frozen=True)
class Draw:
    """The workloads drawn with one seed, their infinite-cache oracles and replica settings."""

    workloads: dict[str, Workload]
    oracle: dict[str, OracleResult]
    sims: dict[str, SimSettings]
    traces: dict[str, dict[tuple[int, int], BlockTrace]]  # each request's blocks (the finite-cache bound)

    @classmethod
    def of(cls, names: Sequence[str], seed: int, *, quick: bool, load: float, replicas: int,
           time_scale: float, backend: str = "sim", profile: SimProfile = PROFILES["default"],
           replica_cost: float = 1.0) -> Draw:
        if backend in ("vllm", "sim-vllm"):
            return cls.vllm(names, seed, quick=quick, load=load, simulated=backend == "sim-vllm")
        workloads = {w: build(w, quick=quick, seed=seed, load=load, max_tokens=profile.max_tokens) for w in names}
        traced = {w: traced_oracle(wl) for w, wl in workloads.items()}
        oracle = {w: o for w, (o, _) in traced.items()}
        sims = {w: smaller_replicas(profile_settings(profile, sim_settings(oracle[w], replicas, time_scale, wl)),
                                    replica_cost) for w, wl in workloads.items()}
        return cls(workloads, oracle, sims, {w: t for w, (_, t) in traced.items()})

    @classmethod
    def vllm(cls, names: Sequence[str], seed: int, *, quick: bool, load: float, simulated: bool = False) -> Draw:
        """The vLLM-sized workloads; the oracle over the tiny model's real tokens at block size 32;
        `simulated`: on simulated engines shaped like the real ones (`bench.lib.sim_vllm`)."""
        tokenizer_json = ensure().tokenizer_json
        tokenizer = HFTokenizer(str(tokenizer_json))
        workloads = {w: build_vllm(w, quick=quick, seed=seed, load=load) for w in names}
        traced = {w: traced_oracle(wl, VLLM_BLOCK_SIZE, vllm_tokens(tokenizer), vllm_answer)
                  for w, wl in workloads.items()}
        engines = (sim_vllm.settings(tokenizer_json, sim_vllm.load_profile()) if simulated else
                   SimSettings(replicas=vllm_backend.ENGINES, kv_cache_blocks=NUM_BLOCKS, block_size=VLLM_BLOCK_SIZE))
        sims = {w: replace(engines, max_num_seqs=max_num_seqs(w, engines.max_num_seqs)) for w in workloads}
        return cls(workloads, {w: o for w, (o, _) in traced.items()}, sims, {w: t for w, (_, t) in traced.items()})
