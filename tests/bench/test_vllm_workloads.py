"""The vLLM-sized workloads and the oracle at vLLM's block size, measured with the tiny model's own
tokenizer.json (testkit/vllm_env.py; skipped where it has not been built): prompts of about 1-4k
real tokens, shared-prefix's working set between one engine's cache and the pool's, cache-pressure's
1.15x the pool's, and cached tokens counted in whole 32-token blocks of the real token ids."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from bench.lib.draws import Draw
from bench.lib.oracle import VLLM_BLOCK_SIZE, vllm_oracle, vllm_tokens, workload_requests
from bench.lib.routers import SimSettings
from bench.lib.vllm_backend import ENGINES
from bench.lib.vllm_workloads import VLLM_SAMPLING, VLLM_WORKLOADS, build_vllm, engine_args, max_num_seqs
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


def _head(prompt: str, words: int) -> str:
    return " ".join(prompt.split()[:words])


def test_hot_prefix_sends_half_its_requests_on_one_system_prompt() -> None:
    w = build_vllm("hot-prefix")
    hot = [s.prompts[0] for s in w.sessions if s.label == "hot"]
    assert len(hot) == w.requests // 2 == 100
    heads = {_head(p, 480) for p in hot}  # the system prompt's 480 words, the same for every hot request
    assert len(heads) == 1 and heads.pop().startswith("System prompt of the hot application:")
    groups = Counter(s.label for s in w.sessions if s.label != "hot")
    assert groups == {f"g{g}": 10 for g in range(10)}
    assert 15 <= w.duration_s <= 35
    assert build_vllm("hot-prefix", quick=True).requests == 100


def test_bursts_arrive_together_on_a_new_prefix_each_and_nothing_between() -> None:
    w = build_vllm("bursts")
    by_burst: dict[str, list[Session]] = {}
    for s in w.sessions:
        by_burst.setdefault(s.label, []).append(s)
    assert list(by_burst) == [f"b{b}" for b in range(8)] and all(len(v) == 20 for v in by_burst.values())
    for b, sessions in enumerate(by_burst.values()):
        starts = [s.start_s for s in sessions]
        assert 3.0 * b <= min(starts) and max(starts) <= 3.0 * b + 0.1
        heads = {_head(s.prompts[0], 480) for s in sessions}
        assert len(heads) == 1 and heads.pop().startswith(f"System prompt of burst {b}:")
    assert build_vllm("bursts", load=2.0).sessions[-1].start_s <= 7 * 1.5 + 0.1  # --load shortens the gaps
    assert build_vllm("bursts", quick=True).requests == 80


def test_decode_heavy_asks_long_answers_of_engines_with_two_slots() -> None:
    w = build_vllm("decode-heavy")
    assert {s.max_tokens for s in w.sessions} == {128} and w.requests == 80
    assert sum(s.label == "hot" for s in w.sessions) == 40
    assert engine_args("decode-heavy") == ("--max-num-seqs", "2")
    assert max_num_seqs("decode-heavy", 256) == 2
    for other in ("shared-prefix", "multi-turn", "cache-pressure", "hot-prefix", "bursts"):
        assert engine_args(other) == () and max_num_seqs(other, 256) == 256
    with pytest.raises(ValueError, match="no vLLM-sized"):
        build_vllm("mixed-length")


def test_hot_prefix_fits_the_pool_but_not_one_engine(tok: HFTokenizer) -> None:
    ws = vllm_oracle(build_vllm("hot-prefix"), tok).working_set_blocks
    assert NUM_BLOCKS * 1.1 < ws < POOL_BLOCKS * 0.7, ws


def test_the_real_engines_draw_carries_each_workloads_slots(tok: HFTokenizer) -> None:
    draw = Draw.vllm(["decode-heavy", "bursts"], 0, quick=True, load=1.0)
    assert draw.sims["decode-heavy"].max_num_seqs == 2
    assert draw.sims["bursts"].max_num_seqs == SimSettings(replicas=2, kv_cache_blocks=1).max_num_seqs
