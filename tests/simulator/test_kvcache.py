"""Paged KV cache: prefix reuse of full blocks, LRU eviction, pinning, events."""

from __future__ import annotations

from prefix_epp_sim.kvcache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCache,
    KVEvent,
    block_hash_seed,
    hash_blocks,
)

BS = 4
SEED = block_hash_seed("m")


def make(num_blocks: int) -> tuple[KVCache, list[KVEvent]]:
    events: list[KVEvent] = []
    return KVCache(num_blocks, BS, events.append), events


def run(cache: KVCache, tokens: list[int], out: int = 0) -> int:
    """Admit, prefill and finish a request; return its cached tokens."""
    hashes = hash_blocks(tokens, BS, SEED)
    alloc = cache.allocate(hashes, len(tokens), len(tokens) + out)
    assert alloc is not None
    cache.commit(alloc, hashes, tokens)
    cache.free(alloc)
    return alloc.cached_tokens


def test_hashes_chain_and_depend_on_seed_and_parent() -> None:
    tokens = list(range(10))
    hashes = hash_blocks(tokens, BS, SEED)
    assert len(hashes) == 2  # only full blocks
    assert hash_blocks([0, 1, 2, 3, 9, 9, 9, 9], BS, SEED)[0] == hashes[0]
    assert hash_blocks([7, 1, 2, 3, 4, 5, 6, 7], BS, SEED)[1] != hashes[1]  # parent differs
    assert hash_blocks(tokens, BS, block_hash_seed("other")) != hashes
    assert hash_blocks(tokens[BS:], BS, SEED, parent=hashes[0]) == hashes[1:]


def test_repeated_prompt_reuses_its_full_blocks() -> None:
    cache, _ = make(16)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert run(cache, prompt) == 0
    assert run(cache, prompt) == 8
    assert run(cache, [*prompt[:6], 99, 98, 97, 96]) == 4  # shared first block only


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    cache, _ = make(16)
    prompt = list(range(12))  # exactly 3 blocks
    run(cache, prompt)
    assert run(cache, prompt) == 8  # as vLLM: at most (n - 1) // block_size blocks hit


def test_lru_eviction_under_pressure_evicts_least_recent_sequence_tail_first() -> None:
    cache, events = make(6)
    a, b, c = [1] * 8 + [0], [2] * 8 + [0], [3] * 8 + [0]  # 3 blocks each, 2 of them full
    run(cache, a)
    run(cache, b)
    events.clear()
    run(cache, c)  # takes the 2 unhashed blocks, then evicts the LRU hashed one: a's tail
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    hashes_a = hash_blocks(a, BS, SEED)
    assert removed == [hashes_a[1]]
    assert cache.match_prefix(hashes_a) == 1
    assert cache.match_prefix(hash_blocks(b, BS, SEED)) == 2
    assert cache.match_prefix(hash_blocks(c, BS, SEED)) == 2
    assert run(cache, a) == 4


def test_sequence_tail_is_evicted_before_its_head() -> None:
    cache, _ = make(5)
    long = [*range(16), 0]  # 4 full blocks + 1
    run(cache, long)
    run(cache, [50, 51, 52, 53, 54])  # needs 2 blocks: one free, one evicted from long's tail
    assert cache.match_prefix(hash_blocks(long, BS, SEED)) == 3


def test_pinned_blocks_are_not_evicted_and_requests_wait_when_full() -> None:
    cache, _ = make(4)
    prompt = [1] * 8 + [0]
    hashes = hash_blocks(prompt, BS, SEED)
    held = cache.allocate(hashes, len(prompt), len(prompt))
    assert held is not None and cache.usage == 0.75
    cache.commit(held, hashes, prompt)
    other = [2] * 8
    assert cache.allocate(hash_blocks(other, BS, SEED), 8, 8) is None  # 1 free block, 2 needed
    # A request sharing the pinned prefix needs only its uncached block.
    shared = cache.allocate(hashes, len(prompt), len(prompt))
    assert shared is not None and shared.cached_tokens == 8 and cache.num_free_blocks == 0
    cache.free(shared)
    cache.free(held)
    assert cache.usage == 0.0
    assert cache.match_prefix(hashes) == 2


def test_output_tokens_reserved_at_admission() -> None:
    cache, _ = make(4)
    assert cache.allocate([], 3, 3 + 13) is not None  # 16 tokens = 4 blocks
    assert cache.allocate([], 1, 1) is None


def test_block_stored_events_carry_chain_tokens_and_parent() -> None:
    cache, events = make(16)
    prompt = list(range(9))
    run(cache, prompt)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert len(stored) == 1
    hashes = hash_blocks(prompt, BS, SEED)
    assert stored[0].block_hashes == hashes
    assert stored[0].parent_block_hash is None
    assert stored[0].token_ids == prompt[:8]
    assert stored[0].block_size == BS
    events.clear()
    longer = [*prompt[:8], 40, 41, 42, 43, 44]
    run(cache, longer)
    (ev,) = [e for e in events if isinstance(e, BlockStored)]
    assert ev.parent_block_hash == hashes[-1]
    assert ev.token_ids == [40, 41, 42, 43]


def test_concurrent_identical_prefill_stores_each_hash_once() -> None:
    cache, events = make(16)
    prompt = list(range(9))
    hashes = hash_blocks(prompt, BS, SEED)
    first = cache.allocate(hashes, 9, 9)
    second = cache.allocate(hashes, 9, 9)
    assert first is not None and second is not None and second.cached_tokens == 0
    cache.commit(first, hashes, prompt)
    cache.commit(second, hashes, prompt)
    assert len([e for e in events if isinstance(e, BlockStored)]) == 1
    cache.free(first)
    cache.free(second)
    assert cache.num_free_blocks == 16 and cache.num_cached_blocks == 2


def test_reset_clears_everything_and_emits_event() -> None:
    cache, events = make(8)
    prompt = list(range(9))
    run(cache, prompt)
    cache.reset()
    assert isinstance(events[-1], AllBlocksCleared)
    assert cache.num_cached_blocks == 0
    assert run(cache, prompt) == 0
