"""KV cache tiers in the precise index: blocks per medium, placeholders resolved through the GPU
tier, announcements counted per tier, bounds, and the tier-weighted match."""

from __future__ import annotations

import random

import pytest

from extproc.kvevents.index import PreciseIndex
from extproc.kvevents.keys import chain_keys, key_seed
from extproc.kvevents.wire import CPU, GPU, STORAGE, Cleared, Removed, Stored, decode_batch
from testkit.kvevents import vllm_batch, vllm_placeholder, vllm_removed, vllm_stored

BS = 16
TOKENS = list(range(2000, 2000 + 8 * BS))
KEYS = chain_keys(TOKENS, BS, key_seed(None))
A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
HASHES = [501 + i for i in range(8)]  # the engine's hashes of TOKENS' blocks


def apply(idx: PreciseIndex, endpoint: str, *events: dict[str, object]) -> None:
    for ev in decode_batch(vllm_batch(list(events))).events:
        idx.apply((endpoint, 0), ev)


def gpu(n: int, start: int = 0) -> dict[str, object]:
    parent = HASHES[start - 1] if start else None
    return vllm_stored(HASHES[start:start + n], parent, TOKENS[start * BS:(start + n) * BS])


def test_a_gpu_hit_outweighs_a_cpu_hit_which_outweighs_a_miss() -> None:
    idx = PreciseIndex(1024)
    apply(idx, A, gpu(8))
    apply(idx, B, gpu(8), *(vllm_placeholder(h, "CPU") for h in HASHES), vllm_removed(HASHES))  # offloaded
    found = idx.match_tiers(KEYS, [A, B, C], 0.0)
    assert found.runs == {A: 8, B: 8}
    assert found.weighted == {A: 8.0, B: pytest.approx(6.4)}
    assert found.blocks[A] == [8, 0, 0] and found.blocks[B] == [0, 8, 0]
    assert idx.held(B, GPU) == 0 and idx.held(B, CPU) == 8 and idx.resolved == 8
    # Each block counts with its best tier: B's first three brought back to GPU weigh 1.
    apply(idx, B, gpu(3))
    assert idx.match_tiers(KEYS, [B], 0.0).weighted[B] == pytest.approx(3 + 5 * 0.8)


def test_tiers_together_hold_one_run_and_storage_weighs_least() -> None:
    idx = PreciseIndex(1024)
    apply(idx, A, gpu(8), vllm_placeholder(HASHES[4], "CPU"), *(vllm_placeholder(h, "STORAGE") for h in HASHES[5:]),
          vllm_removed(HASHES[4:]))
    found = idx.match_tiers(KEYS, [A], 0.0)
    assert found.runs[A] == 8 and found.blocks[A] == [4, 1, 3]
    assert found.weighted[A] == pytest.approx(4 + 0.8 + 3 * 0.3)
    apply(idx, A, vllm_removed([HASHES[4]], "CPU"))  # the run breaks where no tier holds a block
    assert idx.match_tiers(KEYS, [A], 0.0).runs == {A: 4}


def test_self_describing_events_are_taken_as_they_are() -> None:
    idx = PreciseIndex(1024)
    # Blocks 0-3 offloaded with their tokens, chained from a parent on the GPU tier, which was
    # evicted before; blocks 4-7 from a parent on the CPU tier itself.
    apply(idx, A, gpu(1), vllm_stored(HASHES[1:4], HASHES[0], TOKENS[BS:4 * BS], "CPU"),
          vllm_stored(HASHES[4:], HASHES[3], TOKENS[4 * BS:], "CPU"))
    assert idx.match_tiers(KEYS, [A], 0.0).blocks[A] == [1, 7, 0]
    # A self-describing block of a chain nobody announced is an orphan, not indexed.
    apply(idx, B, vllm_stored(HASHES[4:], HASHES[3], TOKENS[4 * BS:], "CPU"))
    assert idx.held(B, CPU) == 0 and idx.orphaned == 4


def test_placeholders_resolve_only_through_the_same_engines_blocks() -> None:
    idx = PreciseIndex(1024)
    apply(idx, A, gpu(8))
    apply(idx, B, *(vllm_placeholder(h, "CPU") for h in HASHES))  # B never announced these on its GPU
    assert idx.held(B, CPU) == 0 and idx.orphaned == 8 and idx.resolved == 0
    # A STORAGE placeholder resolves through the CPU tier once the GPU has evicted the block.
    apply(idx, A, vllm_placeholder(HASHES[0], "CPU"), vllm_removed([HASHES[0]]),
          vllm_placeholder(HASHES[0], "STORAGE"))
    assert idx.held(A, STORAGE) == 1 and idx.resolved == 2


def test_removal_counts_announcements_per_tier() -> None:
    """vLLM re-announces a hash once per offloaded chunk that covers it: it leaves that tier at its last removal."""
    idx = PreciseIndex(1024)
    apply(idx, A, gpu(2), vllm_placeholder(HASHES[0], "CPU"), vllm_placeholder(HASHES[0], "CPU"),
          vllm_placeholder(HASHES[1], "CPU"), vllm_removed(HASHES[:2]))
    assert idx.held(A, CPU) == 2 and idx.entries == 2
    apply(idx, A, vllm_removed(HASHES[:2], "CPU"))
    assert idx.held(A, CPU) == 1 and idx.match(KEYS, [A], 0.0) == {A: 1}
    apply(idx, A, vllm_removed([HASHES[0]], "STORAGE"))  # another tier's removal leaves CPU's block
    assert idx.held(A, CPU) == 1
    apply(idx, A, vllm_removed([HASHES[0]], "CPU"))
    assert idx.held(A, CPU) == 0 and idx.entries == 0 and idx.match(KEYS, [A], 0.0) == {}
    # A GPU removal never touches the CPU tier, and AllBlocksCleared empties every tier.
    apply(idx, A, gpu(2), *(vllm_placeholder(h, "CPU") for h in HASHES[:2]), vllm_removed(HASHES[:2]))
    assert idx.held(A, CPU) == 2 and idx.held(A, GPU) == 0
    idx.apply((A, 0), Cleared())
    assert idx.entries == 0 and idx.held(A, CPU) == 0 and not idx.held_anywhere(KEYS[0])


def test_each_lower_tier_is_bounded_and_purged_with_its_endpoint() -> None:
    idx = PreciseIndex(default_capacity=4)
    idx.set_capacity(A, 8)  # the engine's num_gpu_blocks sizes its GPU tier only
    apply(idx, A, gpu(8), *(vllm_placeholder(h, "CPU") for h in HASHES + HASHES[4:]))
    assert idx.held(A, GPU) == 8 and idx.held(A, CPU) == 4 and idx.evicted == 4
    (cpu,) = idx._lower.values()
    assert cpu.refs == {h: 2 for h in HASHES[4:]}
    apply(idx, A, *(vllm_placeholder(h, "CPU") for h in HASHES[:4]))  # evicts 4-7, and their counts with them
    assert cpu.refs == {} and idx.held(A, CPU) == 4 and idx.evicted == 8
    apply(idx, A, vllm_removed(HASHES))
    assert idx.match(KEYS, [A], 0.0) == {A: 4}  # blocks 0-3 on CPU; 4-7 went from there
    idx.remove_endpoint(A)
    assert idx.entries == 0 and idx._lower == {} and idx._lower_bits == 0


def test_a_tier_of_weight_zero_is_not_indexed() -> None:
    idx = PreciseIndex(1024, weights=(("storage", 0.0), ("cpu", 0.5)))
    apply(idx, A, gpu(4), *(vllm_placeholder(h, "STORAGE") for h in HASHES[:4]),
          *(vllm_placeholder(h, "CPU") for h in HASHES[:2]), vllm_removed(HASHES[:4]))
    assert idx.held(A, STORAGE) == 0 and idx.skipped == 4
    assert idx.match_tiers(KEYS, [A], 0.0).weighted == {A: 1.0}


def test_the_tiered_match_agrees_with_its_definition_under_random_events() -> None:
    """Per candidate: over its sources (and its speculative slot), the run of leading keys some tier
    of the source holds, each key weighed by its best tier; the endpoint's best source by weight."""
    rng = random.Random(5)
    tokens = list(range(7000, 7000 + 16 * BS))
    keys = chain_keys(tokens, BS, key_seed(None))
    idx = PreciseIndex(10, speculative_ttl_s=1.0)
    names = [f"10.0.1.{k}:8000" for k in range(1, 5)]
    weights = idx.weights
    now = 0.0
    for step in range(400):
        now += rng.choice((0.0, 0.3))
        ep, rank = rng.choice(names), rng.randrange(2)
        base = 100_000 * (names.index(ep) * 2 + rank + 1)
        op, n = rng.random(), rng.randrange(1, 17)
        if op < 0.35:
            idx.apply((ep, rank), Stored([base + k for k in range(n)], None, tokens[:n * BS], BS))
        elif op < 0.6:
            tier = rng.choice((CPU, STORAGE))
            idx.apply((ep, rank), Stored([base + rng.randrange(16)], None, [], 0, tier=tier))
        elif op < 0.8:
            idx.apply((ep, rank), Removed([base + rng.randrange(16) for _ in range(3)], tier=rng.randrange(3)))
        elif op < 0.9:
            idx.record_speculative(ep, keys[:rng.randrange(1, 16)], now)
        elif op < 0.93:
            idx.apply((ep, rank), Cleared())
        candidates = rng.sample(names, rng.randrange(1, 5))
        found = idx.match_tiers(keys, candidates, now)
        expected: dict[str, tuple[float, int]] = {}
        for e in candidates:
            groups = [[s for s in idx._slots_of.get(e, ()) if getattr(s, "rank", None) == r] for r in range(2)]
            groups += [[s] for s in idx._slots_of.get(e, ()) if not hasattr(s, "rank")]
            for group in groups:
                w, i = 0.0, 0
                while i < len(keys):
                    held = [weights[getattr(s, "tier", GPU)] for s in group if keys[i] in s.entries]  # type: ignore[attr-defined]
                    if not held:
                        break
                    w, i = w + max(held), i + 1
                if i and (e not in expected or (w, i) > expected[e]):
                    expected[e] = (w, i)
        assert {e: found.runs[e] for e in found.runs} == {e: r for e, (_, r) in expected.items()}, step
        assert found.weighted == {e: pytest.approx(w) for e, (w, _) in expected.items()}, step
