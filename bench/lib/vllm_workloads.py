"""Benchmark workloads for real vLLM (`--backend vllm`): `VLLM_WORKLOADS` sized for two engines of
testkit/vllm.py (512 blocks x 32 tokens = 16,384 tokens of KV cache, one CPU core each). The tiny model's
byte-level BPE splits a bench word into ~4.1 tokens (measured with its tokenizer.json), so sizes
below are words, with real tokens in parentheses; every request adds `VLLM_SAMPLING`
(temperature 0, ignore_eos, skip_special_tokens false: the same answer on either engine, exactly
`max_tokens` tokens, none of them streamed as empty text):
- `shared-prefix`: 10 groups x 20, system 480 words (~2,000 tokens, 62 blocks), question 100
  (~420): prompts 2,300-2,500 tokens; prefix working set ~620 blocks, 1.2x one engine, 0.6x the
  pool; 16 output tokens; 10 requests per second (200 requests, ~20 s).
- `cache-pressure`: the same prompts in 19 groups x 10 (190 requests, 10 per second): working
  set ~1,180 blocks, 1.15x the pool.
- `multi-turn`: 40 chats of 4 turns, 4 system prompts of 240 words (~1,000 tokens), first user
  message 360 words (~1,500), later ones 50 (~210), 24 output tokens, mean think 1 s: prompts
  2,400-3,300 tokens; 2 chats start per second (160 requests, ~20 s of starts).
- `hot-prefix`: shared-prefix's prompts, half of them on ONE system prompt, the rest 10 groups
  x 10 (200 requests, 10 per second, ~20 s): the working set (11 prefixes, ~680 blocks) is
  1.3x one engine, and an engine that takes every hot request takes half the load.
- `bursts`: 8 bursts of 20 requests, one every 3 s, each within 0.1 s; a burst's requests share
  a system prompt no earlier request used (480 words) and each has its own question (100):
  160 requests, ~21 s. Nothing arrives between bursts; a burst is ~10,000 uncached tokens on
  one engine, or its prefix computed twice and the questions split over both.
- `decode-heavy`: long outputs against few sequence slots, the simulator's decode-bound replica
  model (bench.lib.profiles) on real engines: hot-prefix traffic of shorter prompts (4 groups x
  10 and 40 hot requests, system 240 words ~1,000 tokens, question 50 ~210) asking for 128
  output tokens each, 4 per second (80 requests, ~20 s), on engines started with
  `--max-num-seqs 2` (`VLLM_ENGINE_ARGS`): a request holds one of an engine's 2 slots for its
  whole answer, so an engine that takes every hot request queues for slots, not for prefill.
  Sized from the fitted cost model (bench/results/fidelity-profile.json: ~2.9 ms per decode
  step, ~0.4 s per answer): the 4 slots serve ~10 requests per second.
Rates: a round-robin calibration at 6 requests (1.2 chats) per second left the engines mostly
idle (TTFT p50 ~45 ms); at 1.6x that, TTFT p99 reached 350-510 ms with p50 57-82 ms and no
errors (queues form, nothing collapses), so shared-prefix, cache-pressure and multi-turn run at
1.6x; hot-prefix, bursts and decode-heavy are sized from those and the cost model, not yet
calibrated (`--load` scales every rate; bursts: the gaps). `--quick` halves the requests
(bursts: half the bursts).

The generators are bench.lib.workloads' (shared_prefix, multi_turn, cache_pressure, hot_prefix,
bursts); only the sizes, the rates and the sampling differ. `engine_args(name)`: the `vllm
serve` flags a workload's runs need beyond the rig's (bench.lib.vllm_backend restarts the
engines with them, and without them for the next workload).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from bench.lib.workloads import (
    BurstParams,
    MultiTurnParams,
    SharedPrefixParams,
    Workload,
    bursts,
    cache_pressure,
    hot_prefix,
    multi_turn,
    shared_prefix,
)

VLLM_WORKLOADS = ("shared-prefix", "multi-turn", "cache-pressure", "hot-prefix", "bursts", "decode-heavy")
VLLM_ONLY = ("decode-heavy",)  # no simulator workload of that name (there: --sim-profile decode-bound)
VLLM_SAMPLING: tuple[tuple[str, Any], ...] = (("temperature", 0.0), ("ignore_eos", True),
                                              ("skip_special_tokens", False))
# Words, not real tokens; rates calibrated with round-robin on 2 engines (module docstring).
VLLM_PARAMS: Mapping[str, SharedPrefixParams | MultiTurnParams | BurstParams] = {
    "shared-prefix": SharedPrefixParams(groups=10, per_group=20, system_tokens=480, question_tokens=100,
                                        max_tokens=16, rate=10.0),
    "cache-pressure": SharedPrefixParams(groups=19, per_group=10, system_tokens=480, question_tokens=100,
                                         max_tokens=16, rate=10.0),
    "multi-turn": MultiTurnParams(conversations=40, turns=4, system_prompts=4, system_tokens=240,
                                  first_user_tokens=360, user_tokens=50, max_tokens=24, rate=2.0, think_s=1.0),
    "hot-prefix": SharedPrefixParams(groups=10, per_group=10, system_tokens=480, question_tokens=100,
                                     max_tokens=16, rate=10.0, hot_share=0.5),
    "bursts": BurstParams(bursts=8, per_burst=20, gap_s=3.0, spread_s=0.1, system_tokens=480, question_tokens=100,
                          max_tokens=16),
    "decode-heavy": SharedPrefixParams(groups=4, per_group=10, system_tokens=240, question_tokens=50,
                                       max_tokens=128, rate=4.0, hot_share=0.5),
}
DECODE_HEAVY_SEQS = 2
VLLM_ENGINE_ARGS: Mapping[str, tuple[str, ...]] = {"decode-heavy": ("--max-num-seqs", str(DECODE_HEAVY_SEQS))}


def engine_args(name: str) -> tuple[str, ...]:
    """The extra `vllm serve` flags the engines run workload `name` with (module docstring)."""
    return VLLM_ENGINE_ARGS.get(name, ())


def max_num_seqs(name: str, default: int) -> int:
    """The sequence slots per engine workload `name` runs with (`--backend sim-vllm` mirrors them)."""
    args = engine_args(name)
    return int(args[args.index("--max-num-seqs") + 1]) if "--max-num-seqs" in args else default


def _unsized(name: str) -> ValueError:
    return ValueError(f"no vLLM-sized {name!r}; choose from {', '.join(VLLM_WORKLOADS)}")


def build_vllm(name: str, quick: bool = False, seed: int = 0, load: float = 1.0) -> Workload:
    """The named workload of VLLM_WORKLOADS sized for two real engines (module docstring)."""
    p = VLLM_PARAMS.get(name)
    if p is None:
        raise _unsized(name)
    half = 2 if quick else 1
    if isinstance(p, MultiTurnParams):
        w = multi_turn(replace(p, conversations=p.conversations // half, seed=seed, rate=p.rate * load))
    elif isinstance(p, BurstParams):
        w = bursts(replace(p, bursts=p.bursts // half, seed=seed, gap_s=p.gap_s / load))
    else:
        sp = replace(p, per_group=p.per_group // half, seed=seed, rate=p.rate * load)
        if p.hot_share:
            w = replace(hot_prefix(sp), name=name)
        elif name == "shared-prefix":
            w = shared_prefix(sp)
        else:
            w = cache_pressure(sp)
    return replace(w, sessions=tuple(replace(s, sampling=VLLM_SAMPLING) for s in w.sessions))
