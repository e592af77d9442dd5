"""Continuous-batching scheduler: FIFO admission, cost model, cache interplay (no HTTP)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import pytest

from extproc.tokenization.builtin import encode
from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.engine import Engine, SimRequest
from prefix_epp_sim.kvcache import KVCache
from prefix_epp_sim.output import output_text, output_token_ids

FAST = SimConfig(time_scale=200.0, kv_events=False, kv_cache_blocks=4096, max_model_len=8192)


@asynccontextmanager
async def engine(config: SimConfig = FAST) -> AsyncIterator[Engine]:
    eng = Engine(config, KVCache(config.kv_cache_blocks, config.block_size))
    eng.start()
    try:
        yield eng
    finally:
        await eng.close()


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(salt * 7919 + i) % 50_000 + 1 for i in range(n)]


async def finish(eng: Engine, reqs: Sequence[SimRequest]) -> None:
    for r in reqs:
        eng.submit(r)
    await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in reqs)), 10)


def ttft(r: SimRequest) -> float:
    assert r.first_token_at is not None
    return r.first_token_at - r.arrival


def expected_prefill_ttft(cfg: SimConfig, uncached: int) -> float:
    return (cfg.inter_token_latency + cfg.prefill_overhead + cfg.prefill_time_per_token * uncached) / 1000



async def until(cond: Callable[[], bool], timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)

async def test_ttft_follows_cost_model_and_grows_with_uncached_tokens() -> None:
    ttfts = []
    for n in (100, 1000, 4000):
        async with engine() as eng:
            r = SimRequest(prompt(n), max_tokens=2)
            await finish(eng, [r])
            assert ttft(r) == pytest.approx(expected_prefill_ttft(FAST, n), rel=1e-6)
            ttfts.append(ttft(r))
    assert ttfts[0] < ttfts[1] < ttfts[2]


async def test_second_identical_request_hits_cache_and_is_faster() -> None:
    async with engine() as eng:
        first, second = SimRequest(prompt(1000), 4), SimRequest(prompt(1000), 4)
        await finish(eng, [first])
        await finish(eng, [second])
        assert first.cached_tokens == 0
        assert second.cached_tokens == (1000 // 16) * 16  # 992: every full block
        assert ttft(second) == pytest.approx(expected_prefill_ttft(FAST, 1000 - 992), rel=1e-6)
        assert eng.stats.prefix_queries == 2000 and eng.stats.prefix_hits == 992


async def test_a_request_queued_behind_its_prefix_hits_it_while_it_is_computed() -> None:
    """vLLM V1 caches blocks when their chunk is scheduled: a request admitted in the same step
    as the one computing its prefix, or while a long prompt's later chunks still run, hits them."""
    async with engine() as eng:
        shared = prompt(3000)
        first, second = SimRequest(shared + prompt(200, 1), 2), SimRequest(shared + prompt(200, 2), 2)
        await finish(eng, [first, second])  # one step: 3,200 + 3,200 - 3,000 tokens
        assert (first.cached_tokens, second.cached_tokens) == (0, 3000 // 16 * 16)
    cfg = FAST.replace(max_num_batched_tokens=1000)
    async with engine(cfg) as eng:
        first, second = SimRequest(prompt(2500), 2), SimRequest(prompt(2500), 2)
        await finish(eng, [first, second])  # second is admitted in the step of first's last chunk
        assert second.cached_tokens == (2500 - 1) // 16 * 16


async def test_fifo_queue_and_ttft_grows_with_queue_length() -> None:
    cfg = FAST.replace(max_num_seqs=1, time_scale=5.0)  # arrivals a few wall-ms apart stay in order
    async with engine(cfg) as eng:
        reqs = [SimRequest(prompt(500, salt=i), max_tokens=8) for i in range(4)]
        for r in reqs:
            eng.submit(r)
        await asyncio.sleep(0)
        assert len(eng.running) + len(eng.waiting) == 4 and len(eng.running) <= 1
        await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in reqs)), 10)
    firsts = [r.first_token_at or 0.0 for r in reqs]
    assert firsts == sorted(firsts)  # served in arrival order
    waits = [ttft(r) for r in reqs]
    assert all(b > a for a, b in itertools.pairwise(waits))
    # Each request starts when its predecessor ends (prefill + 7 decode steps at batch 1).
    one = expected_prefill_ttft(cfg, 500) + 7 * cfg.inter_token_latency / 1000
    for a, b in itertools.pairwise(firsts):
        assert b - a == pytest.approx(one, rel=1e-6)
    assert eng.stats.queue.count == 4


async def test_decode_slows_with_batch_size() -> None:
    async with engine() as eng:
        alone = SimRequest(prompt(16), 32)
        await finish(eng, [alone])
    async with engine() as eng:
        batch = [SimRequest(prompt(16, salt=i), 32) for i in range(64)]
        await finish(eng, batch)
    assert alone.finished_at is not None and alone.first_token_at is not None
    tpot_alone = (alone.finished_at - alone.first_token_at) / 31
    tpot_batch = max((r.finished_at or 0) - (r.first_token_at or 0) for r in batch) / 31
    assert tpot_alone == pytest.approx(FAST.inter_token_latency / 1000)
    assert tpot_batch == pytest.approx((FAST.inter_token_latency + 63 * FAST.decode_time_per_seq) / 1000)


async def test_chunked_prefill_splits_long_prompt_over_steps() -> None:
    cfg = FAST.replace(max_num_batched_tokens=1000)
    async with engine(cfg) as eng:
        r = SimRequest(prompt(2500), 2)
        await finish(eng, [r])
    # Three prefill steps (1000 + 1000 + 500 tokens), each paying the fixed costs.
    fixed = 3 * (cfg.inter_token_latency + cfg.prefill_overhead) / 1000
    assert ttft(r) == pytest.approx(fixed + 2500 * cfg.prefill_time_per_token / 1000, rel=1e-6)


async def test_request_waits_for_free_blocks() -> None:
    cfg = FAST.replace(kv_cache_blocks=64, max_model_len=1024)  # 1024 tokens of cache
    async with engine(cfg) as eng:
        big = [SimRequest(prompt(600, salt=i), 16) for i in range(2)]
        for r in big:
            eng.submit(r)
        await asyncio.sleep(0)
        assert len(eng.running) == 1 and len(eng.waiting) == 1
        await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in big)), 10)
        assert (big[1].first_token_at or 0) > (big[0].finished_at or 0) > 0
        assert eng.cache.usage == 0.0


async def test_abort_frees_blocks_and_leaves_queue() -> None:
    cfg = FAST.replace(max_num_seqs=1, time_scale=1.0)
    async with engine(cfg) as eng:
        running, queued = SimRequest(prompt(64), 1000), SimRequest(prompt(64, 1), 4)
        eng.submit(running)
        eng.submit(queued)
        await until(lambda: eng.cache.usage > 0)
        assert list(eng.waiting) == [queued]
        eng.abort(queued)
        assert not eng.waiting
        eng.abort(running)
        await until(lambda: not eng.running and eng.cache.usage == 0.0)


async def test_generated_blocks_are_cached_for_the_next_turn() -> None:
    async with engine() as eng:
        text = "word " * 99 + "word\n"  # ends like a chat generation prompt
        first = SimRequest(encode(text), 40)
        await finish(eng, [first])
        follow_up = SimRequest(encode(text + output_text(0, 40) + "<|im_end|>\nmore"), 4)
        await finish(eng, [follow_up])
        assert follow_up.prompt_tokens[:len(first.prompt_tokens) + 40] == first.prompt_tokens + output_token_ids(40)
        # The last sampled token has no KV yet, so prompt + 39 tokens are computed.
        assert follow_up.cached_tokens == (len(first.prompt_tokens) + 39) // 16 * 16 > 96


async def test_lora_adapters_limited_by_max_loras() -> None:
    cfg = FAST.replace(max_loras=1, lora_modules=("a", "b"), time_scale=100.0)
    eng = Engine(cfg, KVCache(cfg.kv_cache_blocks, cfg.block_size), lora_ids={"a": 1, "b": 2})
    eng.start()
    try:
        ra, rb, base = SimRequest(prompt(32), 50, lora="a"), SimRequest(prompt(32), 5, lora="b"), \
            SimRequest(prompt(32), 5)
        for r in (ra, rb, base):
            eng.submit(r)
        await asyncio.sleep(0)
        assert eng.lora_adapters() == (["a"], ["b"])
        await asyncio.wait_for(base.done.wait(), 5)
        assert not rb.finished  # skipped while adapter "a" holds the only slot
        await asyncio.wait_for(asyncio.gather(ra.done.wait(), rb.done.wait()), 5)
        assert rb.cached_tokens == 0  # adapters hash with their own seed
        assert (rb.first_token_at or 0) >= (ra.finished_at or 0)
    finally:
        await eng.close()


async def test_time_scale_divides_wall_time_only() -> None:
    cfg = FAST.replace(time_scale=20.0)
    async with engine(cfg) as eng:
        r = SimRequest(prompt(2000), 20)
        start = time.monotonic()
        await finish(eng, [r])
        wall = time.monotonic() - start
    assert r.finished_at is not None
    model = r.finished_at - r.arrival
    assert model == pytest.approx(expected_prefill_ttft(cfg, 2000) + 19 * cfg.inter_token_latency / 1000)
    assert model / cfg.time_scale * 0.8 <= wall <= model / cfg.time_scale + 0.2


async def test_non_streaming_decode_does_not_wake_per_token() -> None:
    steps = 0

    def count_step() -> None:
        nonlocal steps
        steps += 1

    eng = Engine(FAST, KVCache(FAST.kv_cache_blocks, FAST.block_size), after_step=count_step)
    eng.start()
    try:
        await finish(eng, [SimRequest(prompt(100), 2000)])
        assert steps <= 3  # prefill step + one coalesced decode stretch
        steps = 0
        await finish(eng, [SimRequest(prompt(100, 1), 50, stream=True)])
        assert steps == 50  # streaming: one step per token (stream_interval 1)
    finally:
        await eng.close()


async def test_prompt_tokens_are_counted_with_the_first_token() -> None:
    """As vLLM V1's IterationStats: vllm:prompt_tokens and the TTFT histogram move together, so
    a router pairing them over a window sees every prompt whose first token it counts."""
    async with engine() as eng:
        r = SimRequest(prompt(1000), 2000)
        eng.submit(r)
        await until(lambda: r.first_token_at is not None)
        assert not r.done.is_set()
        assert (eng.stats.ttft.count, eng.stats.prompt_tokens) == (1, 1000)
        await asyncio.wait_for(r.done.wait(), 15)
        assert (eng.stats.ttft.count, eng.stats.prompt_tokens, eng.stats.requests_success) == (1, 1000, 1)
