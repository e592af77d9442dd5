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
Rates: a round-robin calibration at 6 requests (1.2 chats) per second left the engines mostly
idle (TTFT p50 ~45 ms); at 1.6x that, TTFT p99 reached 350-510 ms with p50 57-82 ms and no
errors (queues form, nothing collapses), so these rates are 1.6x. `--quick` halves the requests.

The generators are bench.lib.workloads' (shared_prefix, multi_turn, cache_pressure); only the
sizes, the rates and the sampling differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from bench.lib.workloads import MultiTurnParams, SharedPrefixParams, Workload, cache_pressure, multi_turn, shared_prefix

VLLM_WORKLOADS = ("shared-prefix", "multi-turn", "cache-pressure")
VLLM_SAMPLING: tuple[tuple[str, Any], ...] = (("temperature", 0.0), ("ignore_eos", True),
                                              ("skip_special_tokens", False))
# Words, not real tokens; rates calibrated with round-robin on 2 engines (module docstring).
VLLM_PARAMS: Mapping[str, SharedPrefixParams | MultiTurnParams] = {
    "shared-prefix": SharedPrefixParams(groups=10, per_group=20, system_tokens=480, question_tokens=100,
                                        max_tokens=16, rate=10.0),
    "cache-pressure": SharedPrefixParams(groups=19, per_group=10, system_tokens=480, question_tokens=100,
                                         max_tokens=16, rate=10.0),
    "multi-turn": MultiTurnParams(conversations=40, turns=4, system_prompts=4, system_tokens=240,
                                  first_user_tokens=360, user_tokens=50, max_tokens=24, rate=2.0, think_s=1.0),
}


def build_vllm(name: str, quick: bool = False, seed: int = 0, load: float = 1.0) -> Workload:
    """The named workload of VLLM_WORKLOADS sized for two real engines (module docstring)."""
    p = VLLM_PARAMS.get(name)
    if p is None:
        raise ValueError(f"no vLLM-sized {name!r}; choose from {', '.join(VLLM_WORKLOADS)}")
    if isinstance(p, MultiTurnParams):
        w = multi_turn(replace(p, conversations=p.conversations // (2 if quick else 1), seed=seed, rate=p.rate * load))
    else:
        sp = replace(p, per_group=p.per_group // (2 if quick else 1), seed=seed, rate=p.rate * load)
        w = shared_prefix(sp) if name == "shared-prefix" else cache_pressure(sp)
    return replace(w, sessions=tuple(replace(s, sampling=VLLM_SAMPLING) for s in w.sessions))
