"""The finite-cache bound: the most prefix-cache hits any router could get with the pool's caches.

The infinite-cache oracle (`bench.lib.oracle`) may be out of reach wherever a workload's prefix
working set exceeds the pool's KV caches; then "x% of the oracle" would mix what the router lost
with what no router could keep. This bound keeps the caches' size and drops every other
constraint (on two real vLLM engines it still equals the oracle on multi-turn, whose reused blocks
are 2.5x the pool: the blocks live at any one time fit):

- one cache of `capacity` blocks (the replicas' caches pooled: a router that places a request on
  one replica hits at most the blocks the pool holds, and holding a block twice only wastes room);
- offline-optimal replacement with bypass (Belady's MIN): when the cache is over capacity, the
  block whose next lookup is farthest in the future is dropped (the block just offered included,
  so a block never looked up again is never kept); a block's every appearance in a request is a
  chance to cache it;
- a request's blocks (its prompt's, then the full blocks of its prompt and answer, as vLLM stores
  them) all arrive when it is sent, in the order the run sent them (`RequestResult.sent_s`), and
  every block it looks up counts, not only a leading run (vLLM hits only a prompt's leading
  blocks: counting more can only raise the bound).

Greedy farthest-next-use eviction maximises hits for any sequence of lookups (the exchange
argument: keeping a block needed sooner instead is never worse), so no placement and no per-replica
eviction policy gets more cached tokens out of the same sends: `hit_rate / bound` reads as the
fraction of the possible at that cache size. The bound depends on the order of the sends, so each
run gets its own (a router that answers faster sends a conversation's next turn earlier).

`BlockTrace.of(prompt, output, block_size, seed)` cuts one request into the blocks it looks up
(its prompt's full blocks but the last token's) and the blocks it stores, for this bound and for
the oracle alike (and how many blocks it occupies while it runs, for bench.lib.placement_reference);
`cache_bound(traces, capacity)` replays them in order; `run_bound(results, traces, capacity)` does
so for one run's answered requests in the order they were sent (bench.run: capacity = replicas x
KV-cache blocks each, at the oracle's block size, which is the replicas').
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.lib.client import RequestResult
from prefix_epp_sim.kvcache import hash_blocks


@dataclass(frozen=True)
class BlockTrace:
    prompt_tokens: int
    block_size: int
    looked_up: tuple[int, ...]  # prompt blocks a cache could serve (all but the last prompt token's)
    stored: tuple[int, ...]  # prompt blocks, then the full blocks of prompt + answer
    # Blocks the request occupies while it runs: `stored` and the partly filled last one, if any
    # (the tokens whose KV it computes: the prompt and all but the last generated token); 0: as many
    # as it stores.
    blocks: int = 0

    @classmethod
    def of(cls, prompt: Sequence[int], output: Sequence[int], block_size: int, seed: int) -> BlockTrace:
        n = len(prompt)
        hashes = hash_blocks(prompt, block_size, seed)
        stored = list(hashes)
        computed = n + len(output) - 1  # the last generated token is never stored
        if computed // block_size > len(hashes):
            parent = hashes[-1] if hashes else 0
            tokens = [*prompt, *output]
            stored += hash_blocks(tokens[len(hashes) * block_size:computed], block_size, seed, parent)
        return cls(n, block_size, tuple(hashes[:max(0, (n - 1) // block_size)]), tuple(stored),
                   -(-max(computed, n) // block_size))


@dataclass(frozen=True)
class Bound:
    prompt_tokens: int
    cached_tokens: int
    capacity_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def cache_bound(traces: Sequence[BlockTrace], capacity: int) -> Bound:
    """The most cached prompt tokens `traces`, in this order, can get from `capacity` blocks."""
    never = len(traces)
    # For each stored block of request i: the next request after i that looks it up (never: none).
    upcoming: dict[int, int] = {}
    next_use: list[list[int]] = [[] for _ in traces]
    for i in range(len(traces) - 1, -1, -1):
        next_use[i] = [upcoming.get(h, never) for h in traces[i].stored]
        for h in traces[i].looked_up:
            upcoming[h] = i
    cache: dict[int, int] = {}  # block -> its next lookup
    farthest: list[tuple[int, int]] = []  # (-next lookup, block); entries the cache moved past are stale
    prompt_total = cached = 0
    for trace, uses in zip(traces, next_use, strict=True):
        prompt_total += trace.prompt_tokens
        cached += sum(1 for h in trace.looked_up if h in cache) * trace.block_size
        for h, use in zip(trace.stored, uses, strict=True):
            if use == never:
                cache.pop(h, None)  # not looked up again: its room is better used
            elif cache.get(h) != use:
                cache[h] = use
                heapq.heappush(farthest, (-use, h))
        while len(cache) > capacity:
            use, h = heapq.heappop(farthest)
            if cache.get(h) == -use:
                del cache[h]
    return Bound(prompt_total, cached, capacity)


def run_bound(results: Sequence[RequestResult], traces: Mapping[tuple[int, int], BlockTrace],
              capacity: int) -> Bound:
    """The bound for one run: its answered requests (`ok`), in the order sent, on `capacity` blocks."""
    sent = sorted((r for r in results if r.ok and (r.session, r.turn) in traces), key=lambda r: r.sent_s)
    return cache_bound([traces[(r.session, r.turn)] for r in sent], capacity)
