from __future__ import annotations

import random
import re
import tracemalloc
from collections import OrderedDict
from pathlib import Path

from extproc.prefix.generations import GENERATIONS, MAX_GENS, MIN_GEN
from extproc.prefix.index import BYTES_PER_ENTRY, PrefixIndex
from extproc.prefix.shards import SHARD_MASK


def hashes(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def test_longest_consecutive_prefix_per_endpoint() -> None:
    ix = PrefixIndex(1000)
    h = hashes(10, 1)
    ix.record("a", h[:6])
    ix.record("b", h[:3])
    ix.record("c", h[1:10])  # holds everything but block 0: no usable prefix
    assert ix.match(h, ["a", "b", "c", "d"]) == {"a": 6, "b": 3}
    assert ix.match(h, ["b"]) == {"b": 3}
    assert ix.match(hashes(5, 2), ["a", "b"]) == {}
    assert ix.match([], ["a"]) == {}


def test_full_match_counts_all_blocks() -> None:
    ix = PrefixIndex(100)
    h = hashes(8, 3)
    ix.record("a", h)
    assert ix.match(h, ["a"]) == {"a": 8}


def test_lru_evicts_tail_before_prefix_and_respects_capacity() -> None:
    ix = PrefixIndex(4)
    h = hashes(6, 4)
    ix.record("a", h)
    assert ix.held_by("a") == 4
    assert ix.match(h, ["a"]) == {"a": 4}
    other = hashes(2, 5)
    ix.record("a", other)  # two newer blocks push out the two least recent ones
    assert ix.held_by("a") == 4
    assert ix.match(h, ["a"]) == {"a": 2}
    assert ix.entries == 4


def test_remove_endpoint_purges_everything() -> None:
    ix = PrefixIndex(100)
    h = hashes(5, 6)
    ix.record("a", h)
    ix.record("b", h)
    ix.remove_endpoint("a")
    assert ix.match(h, ["a", "b"]) == {"b": 5}
    assert ix.entries == 5
    ix.remove_endpoint("b")
    assert ix.entries == 0 and ix.distinct_blocks == 0
    ix.record("c", h)  # slots are reused
    assert ix.match(h, ["c"]) == {"c": 5}


def test_clear_endpoint_forgets_its_blocks_and_keeps_its_capacity() -> None:
    ix = PrefixIndex(100)
    h = hashes(5, 8)
    ix.set_capacity("a", 40)
    ix.record("a", h)
    ix.record("b", h)
    ix.clear_endpoint("a")
    assert ix.match(h, ["a", "b"]) == {"b": 5} and ix.held_by("a") == 0 and ix.capacity("a") == 40


def test_set_capacity_shrinks() -> None:
    ix = PrefixIndex(100)
    ix.record("a", hashes(50, 7))
    ix.set_capacity("a", 10)
    assert ix.held_by("a") == 10 and ix.capacity("a") == 10


def test_memory_per_entry_is_bounded() -> None:
    """The bytes-per-entry figure of docs/scheduling.md is BYTES_PER_ENTRY, and that is measured here:
    within 10% either way (an index that got much cheaper or dearer fails as well as a wrong page)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "scheduling.md").read_text()
    found = re.search(r"about (\d+) bytes per \(endpoint, block\) entry", doc)
    assert found is not None and int(found.group(1)) == BYTES_PER_ENTRY
    tracemalloc.start()
    ix = PrefixIndex(100_000)
    before = tracemalloc.get_traced_memory()[0]
    for ep in range(4):
        ix.record(f"10.0.0.{ep}:8000", hashes(20_000, ep))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    per_entry = used / ix.entries
    assert ix.entries == 80_000
    assert BYTES_PER_ENTRY * 0.9 <= per_entry <= BYTES_PER_ENTRY * 1.1, per_entry
    assert ix.approx_bytes() == ix.entries * BYTES_PER_ENTRY


def test_forget_drops_only_that_endpoints_blocks() -> None:
    index = PrefixIndex(default_capacity=100)
    index.record("a", [1, 2, 3])
    index.record("b", [1, 2])
    index.forget("a", [2, 3, 99])
    assert index.match([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 2}
    assert index.held_by("a") == 1 and index.entries == 3
    index.forget("unknown", [1])  # no-op
    assert index.held_by("b") == 2


def test_listeners_see_local_records_only_and_dump_load_round_trips() -> None:
    idx = PrefixIndex(10)
    seen: list[tuple[str, list[int]]] = []
    idx.on_record(lambda ep, hashes: seen.append((ep, list(hashes))))
    idx.record("a:1", [1, 2, 3])
    idx.apply("b:1", [1, 4])  # a peer's decision: same effect, no listener
    assert seen == [("a:1", [1, 2, 3])]
    assert idx.match([1, 4], ["a:1", "b:1"]) == {"a:1": 1, "b:1": 2}
    dumped = dict(idx.dump())
    assert dumped == {"a:1": [3, 2, 1], "b:1": [4, 1]}  # least recently used first
    copy = PrefixIndex(10)
    for ep, hashes in dumped.items():
        copy.load(ep, hashes)
    assert dict(copy.dump()) == dumped and copy.entries == idx.entries


def test_match_sees_endpoints_that_got_a_slot_after_the_same_candidate_list_was_asked() -> None:
    idx = PrefixIndex(100)
    idx.record("a", [1, 2])
    candidates = ["a", "b", "c"]
    assert idx.match([1, 2], candidates) == {"a": 2}
    idx.record("b", [1])  # b had no slot when the list was first asked
    assert idx.match([1, 2], candidates) == {"a": 2, "b": 1}
    idx.remove_endpoint("a")
    idx.record("c", [1, 2])  # c takes a's freed slot
    assert idx.match([1, 2], candidates) == {"b": 1, "c": 2}
    candidates.remove("c")  # the caller's list changed in place: not the list asked before
    assert idx.match([1, 2], candidates) == {"b": 1}
    assert idx.match([1, 2], iter(["c"])) == {"c": 2}


def test_match_agrees_with_a_walk_over_each_endpoints_own_blocks() -> None:
    """Random records of chained prompts (pinned until released, as the scheduler records, or
    not), a record's move to another endpoint (its blocks past what the first one held forgotten
    there), capacity changes and removals. After every step each endpoint's blocks are
    prefix-closed (a block's parent is held wherever the block is), and match (which bisects on
    that) agrees with the definition: the leading blocks each candidate holds."""
    rng = random.Random(7)
    idx = PrefixIndex(40)
    names = [f"e{k}" for k in range(14)]
    parent: dict[int, int] = {}
    child: dict[tuple[int, int], int] = {}

    def chain(length: int) -> list[int]:
        """A path from the root of a tree of 3 children per block: prompts share prefixes, and a
        block's id stands for its whole prefix, as a chained hash does."""
        out, at = [], 0
        for _ in range(length):
            key = (at, rng.randrange(3))
            if key not in child:
                child[key] = len(child) + 1
                parent[child[key]] = at
            at = child[key]
            out.append(at)
        return out

    running: list[tuple[str, list[int]]] = []
    for step in range(2000):
        ep = rng.choice(names)
        op = rng.random()
        if op < 0.65:
            prompt = chain(rng.randrange(1, 25))
            had = idx.match(prompt, [ep]).get(ep, 0)
            pin = rng.random() < 0.5
            idx.record(ep, prompt, pin=pin)
            if rng.random() < 0.1:  # served elsewhere: moved (scheduler.reassign)
                idx.forget(ep, prompt[had:])
                idx.record(rng.choice(names), prompt)
            elif pin:
                running.append((ep, prompt))
        elif op < 0.85 and running:
            idx.release(*running.pop(rng.randrange(len(running))))
        elif op < 0.95:
            idx.set_capacity(ep, rng.randrange(5, 60))
        else:
            idx.remove_endpoint(ep)
        held = {e: set(blocks) for e, blocks in idx.dump()}
        for e, blocks in held.items():
            assert all(parent[b] == 0 or parent[b] in blocks for b in blocks), (step, e)
        candidates = rng.sample(names, rng.randrange(1, 15))
        hashes = chain(rng.randrange(1, 50))
        expected = {}
        for e in candidates:
            n = 0
            while n < len(hashes) and hashes[n] in held.get(e, ()):
                n += 1
            if n:
                expected[e] = n
        assert idx.match(hashes, candidates) == expected, step


def test_the_generations_keep_an_exact_lru_order() -> None:
    """The LRU kept in generations (extproc/prefix/generations.py) against one ordered dict, the
    exact LRU: random records of new and old blocks, forgets and capacity changes at a capacity of
    several generations (so they open, merge and empty); after every step the dump (oldest
    first), the count held, `leading` (walked in the generations) and each block's holder bit agree."""
    rng = random.Random(3)
    capacity = 12 * MIN_GEN
    idx = PrefixIndex(capacity)
    ref: OrderedDict[int, None] = OrderedDict()
    universe = 4 * capacity
    most_gens = 0
    for step in range(400):
        op = rng.random()
        if op < 0.85:
            start = rng.randrange(universe)
            blocks = [(start + k) % universe + 1 for k in range(rng.randrange(1, 300))]
            idx.record("a", blocks)
            for h in reversed(blocks):
                ref.pop(h, None)
                ref[h] = None
        elif op < 0.95:
            gone = [rng.randrange(1, universe + 1) for _ in range(50)]
            idx.forget("a", gone)
            for h in gone:
                ref.pop(h, None)
        else:
            capacity = rng.randrange(4 * MIN_GEN, 20 * MIN_GEN)
            idx.set_capacity("a", capacity)
        while len(ref) > capacity:
            ref.popitem(last=False)
        most_gens = max(most_gens, len(idx._lru["a"].gens))
        assert dict(idx.dump())["a"] == list(ref), step
        # The walk over the generations (`leading`): the leading run of a span of the universe.
        start = rng.randrange(universe)
        span = [(start + k) % universe + 1 for k in range(400)]
        run = next((k for k, h in enumerate(span) if h not in ref), len(span))
        assert idx.leading("a", span) == run, step
        assert idx.held_by("a") == len(ref) == idx.entries == idx.distinct_blocks, step
    assert 4 < most_gens <= MAX_GENS + 1
    for h in ref:
        assert idx._holders[h & SHARD_MASK][h] == 1


def test_a_block_recorded_again_and_again_does_not_grow_the_generations() -> None:
    """One prefix recorded over and over (a hot system prompt) moves within the newest generation:
    it counts once, and only the blocks that are new fill generations (here 1,468 blocks in
    generations of 1,024: two)."""
    idx = PrefixIndex(GENERATIONS * 4 * MIN_GEN)
    hot = hashes(100, 9)
    idx.record("a", hashes(3 * MIN_GEN, 10))
    for i in range(200):
        idx.record("a", hot)
        idx.record("a", hashes(3, 100 + i))
    assert idx.held_by("a") == 3 * MIN_GEN + 100 + 600
    assert len(idx._lru["a"].gens) == 2
    assert dict(idx.dump())["a"][-103:-3] == hot[::-1]  # the last hot record, leading block newest
