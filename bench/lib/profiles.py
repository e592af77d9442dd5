"""Simulator profiles: replica models that break the predicted-TTFT prior's assumptions (`--sim-profile`).

The default simulator is the engine the prior was written for (8B model, one H100, 256 sequence
slots, vLLM's /metrics). The others change one assumption each, so a scheduler that only wins on
its own cost model shows it:

- default: the simulator's defaults, the workloads as defined (64 output tokens).
- decode-bound: 8 sequence slots per replica (--max-num-seqs 8), FIFO beyond them, a streamed
  delta every 8 tokens; every request asks for 128 output tokens, so it holds a slot ~1.2 s and
  one replica's slots run out under a hot prefix (requests wait for slots, not for prefill).
- heterogeneous: the last replica pays every cost 4x (--slow-replicas 1 --slow-factor 4).
- minimal-metrics: /metrics has only running, waiting, KV usage and the cache config
  (--metrics-surface minimal): no TTFT histogram and no prompt-token counter to calibrate on.

`settings(profile, sim)` adds a profile's replica flags to the run's SimSettings; its `max_tokens`
is the output length (0: the workload's own). `smaller_replicas(sim, cost)` makes every replica
pay every cost `cost` times: `bench.run --replicas 16 --replica-cost 4` is the 4-replica pool's
capacity in 16 replicas (how routing quality holds as the pool grows, on a 2-core machine).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench.lib.routers import SimSettings


@dataclass(frozen=True)
class SimProfile:
    name: str
    sim_args: tuple[str, ...] = ()
    max_num_seqs: int = 256
    max_tokens: int = 0  # 0: the workload's own output length


PROFILES = {p.name: p for p in (
    SimProfile("default"),
    SimProfile("decode-bound", ("--stream-interval", "8"), max_num_seqs=8, max_tokens=128),
    SimProfile("heterogeneous", ("--slow-replicas", "1", "--slow-factor", "4")),
    SimProfile("minimal-metrics", ("--metrics-surface", "minimal")),
)}


def settings(profile: SimProfile, sim: SimSettings) -> SimSettings:
    """`sim` with the profile's replica flags."""
    return replace(sim, max_num_seqs=profile.max_num_seqs, sim_args=(*sim.sim_args, *profile.sim_args))


def smaller_replicas(sim: SimSettings, cost: float) -> SimSettings:
    """`sim` with every replica paying every cost `cost` times (1: unchanged)."""
    if cost == 1:
        return sim
    return replace(sim, sim_args=(*sim.sim_args, "--slow-replicas", str(sim.replicas), "--slow-factor", str(cost)))
