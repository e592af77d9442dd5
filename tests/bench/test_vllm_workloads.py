"""The vLLM-sized workloads and the oracle at vLLM's block size, measured with the tiny model's own
tokenizer.json (testkit/vllm_env.py; skipped where it has not been built): prompts of about 1-4k
real tokens, shared-prefix's working set between one engine's cache and the pool's, cache-pressure's
1.15x the pool's, and cached tokens counted in whole 32-token blocks of the real token ids."""

from __future__ import annotations

import random

import pytest

from bench.lib.oracle import VLLM_BLOCK_SIZE, vllm_oracle, vllm_tokens, workload_requests
from bench.lib.vllm_backend import ENGINES
from bench.lib.vllm_workloads import VLLM_SAMPLING, VLLM_WORKLOADS, build_vllm
from bench.lib.workloads import Session, Workload, body, build, text
from extproc.tokenization.tokenizer_json import HFTokenizer
from testkit.vllm import BLOCK_SIZE, NUM_BLOCKS
from testkit.vllm_env import built

POOL_BLOCKS = ENGINES * NUM_BLOCKS


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    env = built()
    if env is None:
        pytest.skip("the tiny model is not built here (make vllm)")
    return HFTokenizer(str(env.tokenizer_json))


@pytest.mark.parametrize("name", VLLM_WORKLOADS)
def test_every_prompt_is_one_to_four_thousand_real_tokens(tok: HFTokenizer, name: str) -> None:
    w = build_vllm(name)
    lengths = [len(ids) for ids, _ in workload_requests(w, vllm_tokens(tok))]
    assert len(lengths) == w.requests >= 80
    assert min(lengths) >= 1000 and max(lengths) <= 4000, (min(lengths), max(lengths))
    # Short answers (prefill-bound), but for decode-heavy's long ones.
    assert all(s.max_tokens == 128 if name == "decode-heavy" else 16 <= s.max_tokens <= 32 for s in w.sessions)
    assert 15 <= w.duration_s <= 35  # a run stays under a minute with its drain and set-up


def test_shared_prefix_fits_the_pool_but_not_one_engine(tok: HFTokenizer) -> None:
    ws = vllm_oracle(build_vllm("shared-prefix"), tok).working_set_blocks
    assert NUM_BLOCKS * 1.1 < ws < POOL_BLOCKS * 0.7, ws  # and leaves room for the running requests


def test_cache_pressure_working_set_is_115_percent_of_the_pool(tok: HFTokenizer) -> None:
    ws = vllm_oracle(build_vllm("cache-pressure"), tok).working_set_blocks
    assert 1.1 <= ws / POOL_BLOCKS <= 1.2, ws / POOL_BLOCKS


def test_vllm_requests_ask_for_deterministic_full_length_answers_and_sim_requests_do_not() -> None:
    _, vllm_body = body(build_vllm("shared-prefix").sessions[0], 0, [])
    assert {k: vllm_body[k] for k, _ in VLLM_SAMPLING} == dict(VLLM_SAMPLING)
    _, sim_body = body(build("shared-prefix", quick=True).sessions[0], 0, [])
    assert not {k for k, _ in VLLM_SAMPLING} & set(sim_body)


def _workload(*sessions: Session) -> Workload:
    return Workload("t", sessions)


def test_oracle_counts_whole_32_token_blocks_of_the_real_token_ids(tok: HFTokenizer) -> None:
    rng = random.Random(1)
    shared = text(rng, 300, "Shared:")
    a, b = shared + text(rng, 40, " first"), shared + text(rng, 40, " second")
    w = _workload(Session(0, 0.0, "completion", (a,), 16), Session(1, 1.0, "completion", (b,), 16))
    ids_a, ids_b = (vllm_tokens(tok)(*body(s, 0, [])) for s in w.sessions)
    assert ids_a[0] == ids_b[0] == tok._tok.token_to_id("<|begin_of_text|>")  # completions carry the BOS
    common = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y)
    result = vllm_oracle(w, tok)
    assert VLLM_BLOCK_SIZE == BLOCK_SIZE
    assert result.prompt_tokens == len(ids_a) + len(ids_b)
    assert result.cached_tokens == common // 32 * 32 > 0
    assert vllm_oracle(w, tok, block_size=16).cached_tokens == common // 16 * 16


def test_oracle_renders_chat_through_the_models_template(tok: HFTokenizer) -> None:
    s = Session(0, 0.0, "chat", ("hello there", "and then"), 24, system="be brief", think_s=(0.0,))
    tokens = vllm_tokens(tok)
    path, request = body(s, 1, ["an answer"])
    chatml = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n"
              "<|im_start|>assistant\nan answer<|im_end|>\n<|im_start|>user\nand then<|im_end|>\n"
              "<|im_start|>assistant\n")
    assert tokens(path, request) == tok._tok.encode(chatml, add_special_tokens=False).ids
    # The second turn reuses the first's prompt blocks (its history extends it).
    long = Session(0, 0.0, "chat", (text(random.Random(2), 400, "doc:"), "next"), 24, system="s", think_s=(0.0,))
    result = vllm_oracle(_workload(long), tok)
    first = len(tokens(*body(long, 0, [])))
    assert result.cached_tokens >= (first - 1) // 32 * 32 - 32
