"""The precise index: dual keys, removal, ranks, speculation, capacity, memory and decoded event batches."""

from __future__ import annotations

import gc
import random
import tracemalloc

from extproc.config.settings import KVEventsConfig
from extproc.kvevents.index import BYTES_PER_ENTRY, PreciseIndex
from extproc.kvevents.keys import chain_keys, key_seed
from extproc.kvevents.wire import Cleared, Removed, Stored, decode_batch
from extproc.prefix.shards import shard_len
from testkit.kvevents import kv_event_batches

BS = 16
TOKENS = list(range(1000, 1000 + 6 * BS))
KEYS = chain_keys(TOKENS, BS, key_seed(None))
A, B = "10.0.0.1:8000", "10.0.0.2:8000"
CAPACITY = KVEventsConfig().index_capacity


def stored(hashes: list[int], parent: int | None, tokens: list[int], lora: str | None = None) -> Stored:
    return Stored(hashes, parent, tokens, BS, lora)


def test_engine_hashes_map_to_our_keys_whatever_the_engine_seed() -> None:
    idx = PreciseIndex(CAPACITY)
    # Two engines with different hash seeds store the same tokens, A in two events chained by parent.
    idx.apply((A, 0), stored([101, 102, 103], None, TOKENS[:3 * BS]))
    idx.apply((A, 0), stored([104, 105, 106], 103, TOKENS[3 * BS:]))
    idx.apply((B, 0), stored([901, 902], None, TOKENS[:2 * BS]))
    assert idx.match(KEYS, [A, B], 0.0) == {A: 6, B: 2}
    assert idx.entries == 8 and idx.orphaned == 0
    # BlockRemoved uses the engine's hashes; the chain breaks at the removed block.
    idx.apply((A, 0), Removed([104]))
    assert idx.match(KEYS, [A, B], 0.0) == {A: 3, B: 2}
    # A child whose parent this source never reported cannot be keyed: an orphan, not indexed.
    idx.apply((B, 0), stored([977], 555, TOKENS[2 * BS:3 * BS]))
    assert idx.orphaned == 1 and idx.match(KEYS, [B], 0.0) == {B: 2}
    idx.apply((A, 0), Cleared())
    assert idx.match(KEYS, [A, B], 0.0) == {B: 2} and idx.held(A) == 0
    # LoRA adapters chain from their own root, so they never match the base model's keys.
    idx.apply((A, 0), stored([301], None, TOKENS[:BS], lora="adapter"))
    assert idx.match(KEYS, [A], 0.0) == {} and "adapter" in idx.lora_names
    assert idx.match(chain_keys(TOKENS, BS, key_seed("adapter")), [A], 0.0) == {A: 1}


def test_data_parallel_ranks_are_kept_apart() -> None:
    idx = PreciseIndex(CAPACITY)
    idx.apply((A, 0), stored([1, 2], None, TOKENS[:2 * BS]))
    idx.apply((A, 1), stored([7, 8, 9, 10], None, TOKENS[:4 * BS]))
    assert idx.match(KEYS, [A], 0.0) == {A: 4}  # the best rank
    idx.apply((A, 1), Removed([9]))  # rank 1 evicts block 2; rank 0's blocks are untouched
    assert idx.match(KEYS, [A], 0.0) == {A: 2}
    idx.apply((A, 1), Removed([1]))  # rank 0's engine hash means nothing on rank 1
    assert idx.match(KEYS, [A], 0.0) == {A: 2} and idx.held(A) == 5


def test_speculative_entries_live_for_the_ttl_and_die_with_a_removal() -> None:
    idx = PreciseIndex(CAPACITY, speculative_ttl_s=2.0)
    idx.record_speculative(B, KEYS, now=10.0)
    assert idx.match(KEYS, [A, B], 11.9) == {B: 6} and idx.speculative(B) == 6
    idx.record_speculative(B, KEYS[:2], now=11.0)  # refreshed: the first two now expire at 13.0
    assert idx.match(KEYS, [B], 12.5) == {B: 2}
    assert idx.match(KEYS, [B], 13.0) == {} and idx.speculative(B) == 0
    idx.apply((B, 0), stored([1, 2, 3], None, TOKENS[:3 * BS]))
    idx.record_speculative(B, KEYS, now=20.0)
    idx.apply((B, 0), Removed([1]))  # the engine evicted block 0: neither kind may claim it now
    assert idx.match(KEYS, [B], 20.5) == {}


def test_capacity_evicts_least_recently_stored_and_prunes_engine_map() -> None:
    idx = PreciseIndex(default_capacity=4)
    idx.apply((A, 0), stored([1, 2, 3, 4, 5, 6], None, TOKENS))
    assert idx.held(A) == 4 and idx.evicted == 2 and idx.match(KEYS, [A], 0.0) == {}  # blocks 0, 1 went
    idx.apply((A, 0), Removed([1, 2]))  # already evicted: nothing happens
    assert idx.entries == 4 and idx.removed == 0
    idx.set_capacity(A, 2)
    assert idx.held(A) == 2 and idx.entries == 2
    idx.record_speculative(A, KEYS, now=0.0)
    idx.remove_endpoint(A)
    assert idx.entries == 0 and idx.match(KEYS, [A], 0.0) == {} and shard_len(idx._holders) == 0


def test_bytes_per_entry_is_measured() -> None:
    n = 50_000
    idx = PreciseIndex(default_capacity=1 << 20)
    rng = random.Random(1)
    tokens = [rng.randrange(128_000) for _ in range(n * BS)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    event = stored([rng.getrandbits(64) for _ in range(n)], None, tokens)  # the engine's hash ints count
    idx.apply(("10.0.0.9:8000", 0), event)
    del event
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_entry = (after - before) / idx.entries
    print(f"precise index: {per_entry:.0f} bytes per entry")
    assert idx.entries == n
    assert 0.5 * BYTES_PER_ENTRY <= per_entry <= 1.25 * BYTES_PER_ENTRY, per_entry


def test_decoded_batches_apply_and_evict_down_to_capacity() -> None:
    """(How fast is a benchmark figure: bench/components.py.)"""
    idx = PreciseIndex(default_capacity=8192)
    for p in kv_event_batches(200, blocks=64, block_size=BS):  # a 64-block prompt stored per batch
        for ev in decode_batch(p).events:
            idx.apply(("10.0.0.9:8000", 0), ev)
    assert idx.stored == 200 * 64 and idx.held("10.0.0.9:8000") == 8192


def test_a_hybrid_models_window_and_state_groups_never_claim_the_prefix() -> None:
    """Group 0 sliding window, group 1 full attention, group 2 mamba (a DeepSeek-V4 / Kimi-K3-like
    layout): only group 1's blocks count, and group 0's removals, as its window moves on, leave
    them resident."""
    idx = PreciseIndex(CAPACITY)
    src = (A, 0)
    for group in (0, 1, 2):  # the decoder marks only the full-attention group indexable
        idx.apply(src, Stored([10 * group + i for i in range(6)], None, TOKENS, BS, None,
                              indexable=group == 1, group=group))
    assert idx.match(KEYS, [A], 0.0) == {A: 6}
    assert idx.skipped == 12
    idx.apply(src, Removed([0, 1, 2, 3, 4, 5], group=0))  # the window slid: the full group still holds them
    idx.apply(src, Removed([20, 21], group=2))
    assert idx.match(KEYS, [A], 0.0) == {A: 6}
    idx.apply(src, Removed([14], group=1))  # the full group evicted block 4: the run stops there
    assert idx.match(KEYS, [A], 0.0) == {A: 4}
    # A second full-attention group repeats the first's hashes: not indexed twice, not removed by it.
    idx.apply(src, Stored([30 + i for i in range(6)], None, TOKENS, BS, None, indexable=True, group=3))
    idx.apply(src, Removed([30, 31], group=3))
    assert idx.match(KEYS, [A], 0.0) == {A: 4}


def test_match_agrees_with_each_slots_own_entries_under_random_events() -> None:
    """Stores, removals, clears, speculation, expiry, eviction and removed endpoints at random,
    a candidate list asked again half of the time (match keeps its slots, and a slot made for one
    of them joins them); match (pool-wide masks, then one slot's entries once a single slot is left) against the
    definition: per candidate, the most leading keys any one of its slots holds."""
    rng = random.Random(11)
    tokens = list(range(5000, 5000 + 24 * BS))
    keys = chain_keys(tokens, BS, key_seed(None))
    idx = PreciseIndex(12, speculative_ttl_s=1.0)
    names = [f"10.0.0.{k}:8000" for k in range(1, 7)]  # up to 18 slots, more than FEW_TO_WALK
    now = 0.0
    for step in range(500):
        now += rng.choice((0.0, 0.1, 0.6))
        ep, rank = rng.choice(names), rng.randrange(2)
        source = (ep, rank)
        serial = 1_000 * (names.index(ep) * 2 + rank + 1)
        op = rng.random()
        if op < 0.5:
            n = rng.randrange(1, 20)
            idx.apply(source, stored([serial + k for k in range(n)], None, tokens[:n * BS]))
        elif op < 0.65:
            idx.apply(source, Removed([serial + rng.randrange(20) for _ in range(3)]))
        elif op < 0.85:
            idx.record_speculative(ep, keys[:rng.randrange(1, 24)], now)
        elif op < 0.9:
            idx.apply(source, Cleared())
        elif op < 0.93:
            idx.remove_endpoint(ep)
        if step == 0 or rng.random() < 0.5:  # else the last list again: its cached slots, and any made since
            candidates = rng.sample(names, rng.randrange(1, 7))
        asked = keys[rng.randrange(2):rng.randrange(2, 24)]
        result = idx.match(asked, candidates, now)  # expires first: the definition below sees the same slots
        expected = {}
        for e in candidates:
            best = 0
            for slot in idx._slots_of.get(e, ()):
                held = slot.entries  # type: ignore[attr-defined]
                n = 0
                while n < len(asked) and asked[n] in held:
                    n += 1
                best = max(best, n)
            if best:
                expected[e] = best
        assert result == expected, step
