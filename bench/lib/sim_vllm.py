"""`--backend sim-vllm`: the real-vLLM rig's workloads on 2 simulated engines shaped like the real ones.

The simulator gets what the real engines have (`testkit.vllm`): 512 KV blocks of 32 tokens, the
tiny model's tokenizer.json (`prefix-epp sim --tokenizer`: the engines' real token ids), and the
cost model `python -m bench.fidelity calibrate` fitted to one engine (PROFILE). The prefix-epp
setups get the picker flags the real rig gives them (`bench.lib.vllm_backend.VllmBackend.picker_args`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.lib.oracle import VLLM_BLOCK_SIZE
from bench.lib.report import RESULTS
from bench.lib.routers import SimSettings
from testkit.vllm import MAX_MODEL_LEN, NUM_BLOCKS

PROFILE = RESULTS / "fidelity-profile.json"
ENGINES = 2
COSTS = ("inter_token_latency", "decode_time_per_seq", "prefill_time_per_token", "prefill_overhead")


def load_profile(path: Path = PROFILE) -> dict[str, Any]:
    if not path.is_file():
        raise SystemExit(f"no fitted profile at {path}: run `python -m bench.fidelity calibrate` first")
    profile: dict[str, Any] = json.loads(path.read_text())["profile"]
    return profile


def sim_flags(profile: dict[str, Any]) -> tuple[str, ...]:
    """`prefix-epp sim` flags of a fitted profile."""
    return tuple(x for k in COSTS for x in (f"--{k.replace('_', '-')}", str(profile[k])))


def settings(tokenizer_json: Path, profile: dict[str, Any]) -> SimSettings:
    tok = str(tokenizer_json)
    # vLLM keeps one of its NUM_BLOCKS aside (the block pool's null block): the engines use the rest
    # (tests/e2e/test_vllm_cache_model.py: the simulator's cache at NUM_BLOCKS - 1 gives their hits).
    return SimSettings(replicas=ENGINES, kv_cache_blocks=NUM_BLOCKS - 1, block_size=VLLM_BLOCK_SIZE,
                       max_model_len=MAX_MODEL_LEN, sim_args=(*sim_flags(profile), "--tokenizer", tok),
                       picker_args=("--tokenizer", tok, "--kv-events-block-size", str(VLLM_BLOCK_SIZE)))
