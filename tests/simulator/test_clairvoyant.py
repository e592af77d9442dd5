"""The clairvoyant front: exact cached tokens, the cost model's prediction, the choice, and real HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest

from prefix_epp_sim.clairvoyant import Clairvoyant, clairvoyant_front, predict_ttft_ms, queued_prefill_tokens
from prefix_epp_sim.cli import build_parser, config_from_args
from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.engine import Engine, SimRequest
from prefix_epp_sim.kvcache import hash_blocks
from prefix_epp_sim.openai_api import Generation
from prefix_epp_sim.server import Replica, run_replicas

CFG = SimConfig(kv_events=False, kv_cache_blocks=4096, max_model_len=32768)
BS = CFG.block_size


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def replica(index: int, config: SimConfig = CFG) -> Replica:
    return Replica(config, index, "127.0.0.1", 9000 + index)  # never started: only its engine and cache


def hashes_of(engine: Engine, prompt: list[int]) -> list[int]:
    return hash_blocks(prompt, BS, engine.seed_for(None))


def warm(engine: Engine, prompt: list[int]) -> None:
    """Leave `prompt`'s full blocks cached (and idle) in the engine's KV cache."""
    hashes = hashes_of(engine, prompt)
    alloc = engine.cache.allocate(hashes, len(prompt), len(prompt) + 1)
    assert alloc is not None
    engine.cache.commit(alloc, hashes, prompt)
    engine.cache.free(alloc)


def waiting(engine: Engine, prompt: list[int]) -> SimRequest:
    req = SimRequest(prompt, 8, prompt_hashes=hashes_of(engine, prompt))
    engine.waiting.append(req)
    return req


def generation(prompt: list[int]) -> Generation:
    return Generation("completion", "sim-model", None, prompt, 8, True, True)


def test_prediction_on_an_idle_cold_replica_is_the_cost_model() -> None:
    engine = replica(0).engine
    prompt = tokens(1, 7200)
    # One step with 7,200 prefill tokens: 8 ms + 2 ms + 0.06 ms x 7,200.
    assert predict_ttft_ms(engine, hashes_of(engine, prompt), len(prompt)) == pytest.approx(8.0 + 2.0 + 0.06 * 7200)
    long_prompt = tokens(1, 20000)  # three chunks of at most 8,192 tokens
    assert predict_ttft_ms(engine, hashes_of(engine, long_prompt), 20000) == pytest.approx(3 * 10.0 + 0.06 * 20000)


def test_cached_tokens_are_counted_exactly_without_touching_the_lru_order() -> None:
    engine = replica(0).engine
    shared = tokens(1, 640)  # 40 full blocks
    warm(engine, shared + tokens(100_000, 333))  # the same 40 blocks, then another tail
    prompt = shared + tokens(200_000, 360)
    order = list(engine.cache._free)
    cold = predict_ttft_ms(replica(1).engine, hashes_of(engine, prompt), len(prompt))
    warm_ms = predict_ttft_ms(engine, hashes_of(engine, prompt), len(prompt))
    assert cold - warm_ms == pytest.approx(0.06 * 640)  # exactly the 40 cached blocks are not computed
    assert list(engine.cache._free) == order
    # A prompt cached in full still computes its last token: at most (n - 1) // 16 blocks hit.
    exact = tokens(1, 640)
    assert predict_ttft_ms(engine, hashes_of(engine, exact), 640) == pytest.approx(10.0 + 0.06 * 16)


def test_queued_work_counts_waiting_uncached_and_running_prefill() -> None:
    engine = replica(0).engine
    warm(engine, tokens(1, 1600))
    waiting(engine, tokens(1, 1600) + tokens(50_000, 400))  # its first 100 blocks cached
    waiting(engine, tokens(70_000, 1000))  # nothing cached
    running = SimRequest(tokens(90_000, 3000), 8)
    running.prefill_left = 1200
    decoding = SimRequest(tokens(95_000, 100), 8)
    engine.running.extend([running, decoding])
    assert queued_prefill_tokens(engine) == (2000 - 1600) + 1000 + 1200
    prompt = tokens(300_000, 500)
    work = 400 + 1000 + 1200 + 500
    # One step: the decoding request, the running prefill, both waiting ones and ours (5 sequences).
    assert predict_ttft_ms(engine, hashes_of(engine, prompt), 500) == pytest.approx(8.0 + 2.0 + 0.15 * 4 + 0.06 * work)


def test_a_prefix_still_computing_is_hit_by_a_request_queued_behind_it() -> None:
    """Blocks are cached once the chunk computing them is scheduled (vLLM V1): a request
    admitted in the same step as the one computing its prefix hits all of it."""
    engine = replica(0).engine
    system = tokens(1, 6000)
    waiting(engine, system + tokens(10_000, 1200))  # 7,200 tokens: one step, 992 tokens of budget left
    prompt = system + tokens(20_000, 1200)
    hit = 6000 // 16 * 16
    # Step 1: the 7,200 and the first 992 of ours (2 sequences); step 2: the rest of ours.
    alongside = 8.0 + 2.0 + 0.15 + 0.06 * 8192 + 8.0 + 2.0 + 0.06 * (7200 - hit - 992)
    assert predict_ttft_ms(engine, hashes_of(engine, prompt), len(prompt)) == pytest.approx(alongside)


def test_a_prompt_longer_than_a_step_is_hit_once_its_last_chunk_is_scheduled() -> None:
    engine = replica(0).engine
    system = tokens(1, 12_000)
    waiting(engine, system + tokens(10_000, 1200))  # 13,200 tokens: 8,192 then 5,008 with ours
    prompt = system + tokens(20_000, 1200)
    hit = 12_000 // 16 * 16
    expected = 8.0 + 2.0 + 0.06 * 8192 + 8.0 + 2.0 + 0.15 + 0.06 * (5008 + 13_200 - hit)
    assert predict_ttft_ms(engine, hashes_of(engine, prompt), len(prompt)) == pytest.approx(expected)


def test_a_long_queue_on_the_warm_replica_loses_to_an_idle_cold_one() -> None:
    warm_r, cold_r = replica(0), replica(1)
    system = tokens(1, 6000)
    warm(warm_r.engine, system)
    prompt = system + tokens(500_000, 1200)
    for k in range(6):  # 6 x 7,200 uncached tokens queued ahead on the warm replica
        waiting(warm_r.engine, tokens(1_000_000 + k * 10_000, 7200))
    assert Clairvoyant([warm_r, cold_r], seed=0).choose(generation(prompt)) is cold_r
    warm_r.engine.waiting.clear()  # without the queue the cached prefix wins
    waiting(warm_r.engine, tokens(2_000_000, 1000))  # a short queue is worth less than 6,000 cached tokens
    assert Clairvoyant([cold_r, warm_r], seed=0).choose(generation(prompt)) is warm_r


def test_ties_are_broken_at_random_with_a_seed() -> None:
    replicas = [replica(i) for i in range(4)]
    prompt = generation(tokens(1, 100))
    a = Clairvoyant(replicas, seed=3)
    b = Clairvoyant(replicas, seed=3)
    seq_a = [a.choose(prompt).index for _ in range(40)]
    assert seq_a == [b.choose(prompt).index for _ in range(40)]
    assert set(seq_a) == {0, 1, 2, 3}  # all four idle replicas tie


def test_cli_flag_sets_the_front_port() -> None:
    assert config_from_args(build_parser().parse_args([])).clairvoyant_port is None
    assert config_from_args(build_parser().parse_args(["--clairvoyant-port", "0"])).clairvoyant_port == 0


@asynccontextmanager
async def front(n: int) -> AsyncIterator[tuple[list[Replica], str, aiohttp.ClientSession]]:
    config = CFG.replace(time_scale=20.0)
    async with run_replicas(config, n, base_port=0) as replicas, \
            clairvoyant_front(replicas, config, 0) as f, aiohttp.ClientSession() as session:
        yield replicas, f.url, session


async def stream(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[str, int, dict[str, Any]]:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    texts = 0
    usage: dict[str, Any] = {}
    async with session.post(url + "/v1/completions", data=orjson.dumps(body),
                            headers={"content-type": "application/json"}) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        served_by = resp.headers["x-served-by"]
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunk = orjson.loads(line[6:])
                texts += sum(1 for c in chunk["choices"] if c.get("text"))
                usage = chunk.get("usage") or usage
    return served_by, texts, usage


async def test_front_serves_over_http_sends_repeats_home_and_spreads_concurrent_arrivals() -> None:
    system = " ".join(f"w{i}" for i in range(3000))
    async with front(2) as (replicas, url, session):
        addresses = {r.address for r in replicas}
        async with session.get(url + "/health") as resp:
            assert resp.status == 200
        first, texts, usage = await stream(session, url, system + " first question")
        assert first in addresses and texts == 4 and usage["completion_tokens"] == 4
        again, _, usage = await stream(session, url, system + " second question")
        assert again == first and usage["prompt_tokens_details"]["cached_tokens"] > 2000
        # Two unrelated long prompts at once: the second sees the first queued and goes elsewhere.
        both = await asyncio.gather(stream(session, url, "alpha " * 6000), stream(session, url, "beta " * 6000))
        assert {both[0][0], both[1][0]} == addresses
        async with session.post(url + "/v1/completions", data=b"{not json") as resp:
            assert resp.status == 400
