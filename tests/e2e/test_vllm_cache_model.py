"""Two models of vLLM's prefix cache against a real engine, request by request.

The placement reference of the real-vLLM benchmark replays a run through a model of each engine's
prefix cache (bench.lib.placement_reference.EngineCache: vLLM's block pool, leading hits, a free
queue evicted least recently freed first, a finished request's blocks freed tail first), and the
simulator's replicas keep their own (prefix_epp_sim.kvcache.KVCache). Here one real engine
(testkit/vllm.py: 512 blocks of 32 tokens, one core) serves a sequence larger than its cache, one
request at a time, and both models, given the engine's 511 usable blocks, must give the cached
tokens vLLM reports for every request: evictions and all.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from bench.lib.cache_bound import BlockTrace
from bench.lib.placement_reference import EngineCache
from prefix_epp_sim.kvcache import KVCache, hash_blocks
from testkit.tiny_model import TEXT
from testkit.vllm import BLOCK_SIZE, NUM_BLOCKS, Engine, engines
from testkit.vllm_env import MODEL_NAME

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(600)]

WORDS = TEXT.split()
DOCUMENTS = 9


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def sequence() -> list[str]:
    """Prompts over DOCUMENTS long prefixes of several lengths, each with a question of its own; a
    document asked again soon is likelier (as a conversation's next turn is), so some reuses find
    their blocks, some find them evicted, some only their first blocks (a prompt's tail is evicted
    first)."""
    rng = random.Random(7)
    documents = [words(500 + d, 1300 + 400 * (d % 4)) for d in range(DOCUMENTS)]
    order = list(range(DOCUMENTS))
    prompts = []
    for i in range(28):
        d = order[-1 - min(int(rng.expovariate(0.25)), DOCUMENTS - 1)] if i >= DOCUMENTS else i
        order.remove(d)
        order.append(d)
        prompts.append(documents[d] + " " + words(9000 + i, 12 + rng.randrange(30)))
    return prompts


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with engines(tmp_path_factory.mktemp("vllm-cache"), 1) as started:
        yield started[0]


def test_both_cache_models_give_vllms_cached_tokens_for_every_request(engine: Engine) -> None:
    engine.reset_prefix_cache()
    # vLLM's block pool keeps one of its blocks aside (the null block): 511 of 512 hold prefixes.
    model, unbounded = EngineCache(NUM_BLOCKS - 1), EngineCache(10**6)
    simulator = KVCache(NUM_BLOCKS - 1, BLOCK_SIZE)
    one_more = EngineCache(NUM_BLOCKS)  # the null block counted: the sequence tells the difference
    real: list[int] = []
    modelled: list[int] = []
    simulated: list[int] = []
    with_512: list[int] = []
    without_eviction: list[int] = []
    for prompt in sequence():
        ids = engine.post("/tokenize", {"model": MODEL_NAME, "prompt": prompt})["tokens"]
        reply = engine.post("/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2,
                                                "temperature": 0})
        real.append(int(reply["usage"]["prompt_tokens_details"]["cached_tokens"]))
        assert int(reply["usage"]["prompt_tokens"]) == len(ids)
        # The answer's own tokens are never looked up again here; only the blocks they fill count.
        trace = BlockTrace.of(ids, [0] * 2, BLOCK_SIZE, seed=0)
        for cache, out in ((model, modelled), (one_more, with_512), (unbounded, without_eviction)):
            out.append(cache.start(trace) * BLOCK_SIZE)
            cache.end(trace)
        hashes = hash_blocks(ids, BLOCK_SIZE, seed=0)
        allocation = simulator.allocate(hashes, len(ids), len(ids) + 2)
        assert allocation is not None
        simulated.append(allocation.cached_tokens)
        simulator.commit(allocation, hashes, ids)
        simulator.free(allocation)
    assert modelled == real
    assert simulated == real
    assert with_512 != real
    # The sequence does evict: reuses an unbounded cache would serve found their blocks gone, some
    # of them all but their first blocks.
    pairs = list(zip(real, without_eviction, strict=True))
    assert sum(a < b for a, b in pairs) >= 2 and any(0 < a < b for a, b in pairs), pairs
    assert sum(real) > 0
