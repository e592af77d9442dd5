"""Approximate prefix-cache index: which endpoint probably holds which prompt blocks.

Structure:
- Each endpoint gets a small integer slot; `_holders` maps block hash -> bitmask of slots that
  hold it, in shards (extproc/prefix/shards.py: no update rebuilds millions of entries at once).
- Each endpoint has an LRU of its block hashes (extproc/prefix/generations.py: insertion order in
  generations of bounded size; recording a block moves it to the end). When an endpoint holds
  more than its capacity, its least recently used blocks are evicted and its bit is cleared in
  `_holders` (the entry disappears when no bit is left).

Operations:
- `match(hashes, candidates)`: the longest run of leading blocks that each candidate holds
  (consecutive from block 0, as on a paged KV cache). With the candidates still holding every
  block so far as a bitmask, it finds the first block some of them do not hold by bisection
  (below, "Prefix-closed"), drops those, and goes on with the rest: about 2 log2(run) holder
  lookups per drop, where a walk took one per block, each a cache miss once the shards outgrow
  the CPU caches (a 400-block shared prefix held by a dozen of 256 endpoints: ~18 lookups, not
  400). A prompt nobody holds costs one lookup. The candidates' mask is kept while the same list
  is asked again (the pool, request after request) and no slot changed. `leading(endpoint,
  hashes)` walks one endpoint's generations instead, in C.
- `record(endpoint, hashes)`: the chosen endpoint now holds the prompt's blocks; its first block
  becomes the most recently used entry.
- `record_later(endpoint, hashes, pin)` and `flush()`: the same record, its work deferred. The
  scheduler records this way and flushes on the event loop's next turn
  (extproc/scheduling/scheduler.py), so a decision's answer goes out before the record's inserts
  and evictions, the larger part of a decision at a large pool (docs/scale.md). Every method that
  reads or changes the index flushes first, so no reader ever sees the index without a record
  already made. With `pin`, the blocks stay held while the request runs, out of the eviction
  order (extproc/prefix/generations.py: as the engine keeps in-use blocks out of its free queue)
  until `release(endpoint, hashes)` at its end puts them back as the most recently used.
- `remove_endpoint(endpoint)`: purges everything the endpoint held (it left the pool).
- `on_record(listener)`: listeners see every local `record` (peer sync publishes them);
  `apply(endpoint, hashes)` records what a peer decided without notifying them, so nothing echoes.
- `dump()` / `load(endpoint, hashes)`: each endpoint's blocks oldest first, and their restore in
  that order (the warm-start snapshot, extproc/sync/).

Prefix-closed: the hashes are chained (extproc/prefix/hashing.py: block j's hash stands for its
whole prefix), and an endpoint that holds block j of a chain holds blocks 0..j - 1 too: a record
holds all of its prompt and inserts it last block first, so no block is less recently used than
the one after it and eviction takes a prompt's tail first; pins hold and release a request's
blocks together, in that order; a move to another endpoint (`forget`) drops a record's tail.
So along a chain the holders only shrink, which `match`'s bisection reads. A list that is not a
chain (a faulty peer's), or a continuation recorded while its prefix's record is moved away, can
break it for the blocks it names: `match` may count that hole as held, a wrong hint that ages
out with them (tests/prefix/test_index.py checks the property under random records, pins,
releases, moves, capacity changes and removals).

Memory is bounded by sum(capacity) entries; `approx_bytes()` estimates it from the measured cost
per entry (see docs/scheduling.md, "Prefix index": about 100 bytes per (endpoint, block) entry on
CPython 3.11, the hash int, a slot in a holders shard and a slot in an LRU generation).

Capacity per endpoint is `default_capacity` (`--prefix-lru-capacity`,
PrefixConfig.lru_capacity_per_server: the Go EPP's lruCapacityPerServer, 31250 blocks of 16 tokens,
~500k tokens) until it is tuned per endpoint from the engine's reported `num_gpu_blocks`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from extproc.prefix.generations import PIN_BOUND, Generations
from extproc.prefix.shards import SHARD_MASK, clear_bit, first_short, new_shards, shard_len


class Keyed(Protocol):
    @property
    def key(self) -> str: ...


# Measured with tracemalloc (tests/prefix/test_index.py::test_memory_per_entry_is_bounded).
BYTES_PER_ENTRY = 100


class PrefixIndex:
    def __init__(self, default_capacity: int) -> None:
        if default_capacity <= 0:
            raise ValueError("capacity must be positive")
        self.default_capacity = default_capacity
        self._holders = new_shards()
        self._lru: dict[str, Generations] = {}
        self._slot: dict[str, int] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._capacity: dict[str, int] = {}
        self._entries = 0
        self._listeners: list[Callable[[str, Sequence[int]], None]] = []
        # The last candidate list `match` saw, its slots' mask and slot -> endpoint: the scheduler
        # asks with the same pool request after request. Dropped whenever a slot is given or freed.
        self._candidates: tuple[list[str], int, dict[int, str]] | None = None
        self._pending: list[tuple[str, Sequence[int], bool]] = []  # record_later's, oldest first
        # endpoint -> id(hashes) -> hashes of each request pinned there (`release` unpins only
        # what a record pinned; holding the list keeps its id from being reused meanwhile).
        self._pinned: dict[str, dict[int, Sequence[int]]] = {}

    # -- endpoints -------------------------------------------------------------------------
    def _slot_of(self, endpoint: str) -> int:
        slot = self._slot.get(endpoint)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                slot = self._next_slot
                self._next_slot += 1
            self._slot[endpoint] = slot
            self._lru[endpoint] = Generations()
            self._candidates = None
        return slot

    def set_capacity(self, endpoint: str, capacity: int) -> None:
        """Set one endpoint's capacity in blocks (e.g. from vllm:cache_config_info)."""
        if self._pending:
            self.flush()
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self._capacity[endpoint] = capacity
        if endpoint in self._lru:
            self._evict(endpoint, self._slot[endpoint], capacity)

    def capacity(self, endpoint: str) -> int:
        return self._capacity.get(endpoint, self.default_capacity)

    def clear_endpoint(self, endpoint: str) -> None:
        """Forget what an endpoint holds (its engine restarted), keeping its capacity."""
        capacity = self._capacity.get(endpoint)
        self.remove_endpoint(endpoint)
        if capacity is not None:
            self._capacity[endpoint] = capacity

    def remove_endpoint(self, endpoint: str) -> None:
        if self._pending:
            self.flush()
        slot = self._slot.pop(endpoint, None)
        self._capacity.pop(endpoint, None)
        if slot is None:
            return
        lru = self._lru.pop(endpoint)
        self._pinned.pop(endpoint, None)
        clear = ~(1 << slot)
        holders = self._holders
        for h in lru:
            clear_bit(holders, h, clear)
        self._entries -= lru.size
        self._free_slots.append(slot)
        self._candidates = None

    def endpoints(self) -> list[str]:
        if self._pending:
            self.flush()
        return list(self._slot)

    # -- request path ----------------------------------------------------------------------
    def _candidate_slots(self, candidates: Iterable[str]) -> tuple[int, dict[int, str]]:
        """(mask of the candidates' slots, slot -> candidate), reused while the list is the same."""
        listed = candidates if isinstance(candidates, list) else list(candidates)
        cached = self._candidates
        if cached is not None and cached[0] == listed:
            return cached[1], cached[2]
        slots = self._slot
        active = 0
        by_slot: dict[int, str] = {}
        for ep in listed:
            slot = slots.get(ep)
            if slot is not None:
                active |= 1 << slot
                by_slot[slot] = ep
        self._candidates = (list(listed), active, by_slot)
        return active, by_slot

    def match(self, hashes: Sequence[int], candidates: Iterable[str]) -> dict[str, int]:
        """Number of leading blocks each candidate holds; candidates holding none are omitted.
        `hashes` is a chain (module docstring, "Prefix-closed"): the candidates that hold its
        block j + 1 hold its block j, so the first block not held by all of `active` is found
        by bisection (shards.py's `first_short`); each one found drops some candidates, the rest go on."""
        if self._pending:
            self.flush()
        active, by_slot = self._candidate_slots(candidates)
        result: dict[str, int] = {}
        if not active or not hashes:
            return result
        holders = self._holders
        n = len(hashes)
        i = 0
        while True:
            j = first_short(holders, hashes, i, active)
            if j == n:
                self._assign(active, n, by_slot, result)
                return result
            h = hashes[j]
            nxt = holders[h & SHARD_MASK].get(h, 0) & active
            self._assign(active & ~nxt, j, by_slot, result)
            if not nxt:
                return result
            active, i = nxt, j + 1

    def leading(self, endpoint: str, hashes: Sequence[int]) -> int:
        """`match(hashes, [endpoint])` for one endpoint, without touching the candidate cache."""
        if self._pending:
            self.flush()
        lru = self._lru.get(endpoint)
        return lru.leading(hashes, 0) if lru is not None and hashes else 0

    @staticmethod
    def _assign(mask: int, matched: int, by_slot: dict[int, str], result: dict[str, int]) -> None:
        if matched == 0:
            return
        while mask:
            low = mask & -mask
            result[by_slot[low.bit_length() - 1]] = matched
            mask ^= low

    def on_record(self, listener: Callable[[str, Sequence[int]], None]) -> None:
        self._listeners.append(listener)

    def record(self, endpoint: str, hashes: Sequence[int], pin: bool = False) -> None:
        """Note that `endpoint` now holds these blocks (most recently used); tell the listeners.
        `pin`: a running request's, held until `release(endpoint, hashes)` with the same list."""
        if self._pending:
            self.flush()
        self._record(endpoint, hashes, pin)

    def record_later(self, endpoint: str, hashes: Sequence[int], pin: bool = False) -> bool:
        """`record`, deferred until `flush` or the next method that reads the index; True when
        nothing was pending before (the caller then arranges one `flush`)."""
        if not hashes:
            return False
        first = not self._pending
        self._pending.append((endpoint, hashes, pin))
        return first

    def flush(self) -> None:
        """Make the deferred records, oldest first."""
        pending = self._pending
        if pending:
            self._pending = []
            for endpoint, hashes, pin in pending:
                self._record(endpoint, hashes, pin)

    def release(self, endpoint: str, hashes: Sequence[int]) -> None:
        """The request whose record pinned these blocks on `endpoint` (the same list) ended there:
        those no other running request holds go back as the most recently used, as the engine's
        free queue orders a finished request's blocks. Not told to the listeners (peers learnt
        the record; its end is this picker's)."""
        if self._pending:
            self.flush()
        requests = self._pinned.get(endpoint)
        if requests is None or requests.pop(id(hashes), None) is None:
            return
        if not requests:
            del self._pinned[endpoint]
        lru = self._lru[endpoint]
        lru.unpin(hashes[::-1])
        self._settle(endpoint, self._slot[endpoint], lru)

    def _record(self, endpoint: str, hashes: Sequence[int], pin: bool = False) -> None:
        if not hashes:
            return
        if pin:
            # At most PIN_BOUND capacities pinned: ends that are never reported (an in-process
            # caller that does not complete) leave a bounded residue; beyond, a request is
            # recorded unpinned. Not the capacity itself: that is the engine's cache at the
            # learned bytes per token (capacity.py), the prior's until measured.
            lru = self._lru.get(endpoint)
            bound = PIN_BOUND * self._capacity.get(endpoint, self.default_capacity)
            requests = self._pinned.get(endpoint)
            if (lru is not None and len(lru.pinned) >= bound) or (requests is not None and id(hashes) in requests):
                pin = False
            elif requests is None:
                self._pinned[endpoint] = {id(hashes): hashes}
            else:
                requests[id(hashes)] = hashes
        # Leading blocks last: they become the most recently used, so under pressure a prompt's
        # tail is evicted before its prefix, as vLLM frees the tail blocks of a sequence first.
        self._insert(endpoint, reversed(hashes), pin)
        for listener in self._listeners:
            listener(endpoint, hashes)

    def apply(self, endpoint: str, hashes: Sequence[int]) -> None:
        """`record` of a peer's decision: same effect on the index, no listener is told."""
        if self._pending:
            self.flush()
        if hashes:
            self._insert(endpoint, reversed(hashes))

    def load(self, endpoint: str, hashes: Iterable[int]) -> None:
        """Insert blocks in the given order (oldest first), as `dump` yields them."""
        if self._pending:
            self.flush()
        self._insert(endpoint, hashes)

    def dump(self) -> Iterator[tuple[str, list[int]]]:
        """(endpoint, its blocks from least to most recently used), one copy per endpoint."""
        if self._pending:
            self.flush()
        for endpoint in list(self._lru):
            lru = self._lru.get(endpoint)
            if lru is not None:
                yield endpoint, list(lru)

    def _insert(self, endpoint: str, ordered: Iterable[int], pin: bool = False) -> None:
        """Record `ordered` (least recently used first) at the newest end, or pinned (out of the
        order, generations.py)."""
        slot = self._slot_of(endpoint)
        bit = 1 << slot
        lru = self._lru[endpoint]
        newest, pinned = lru.gens[-1], lru.pinned
        holders = self._holders
        added = 0
        for h in ordered:
            if pinned and h in pinned:  # a running request's: out of the order until no one runs it
                if pin:
                    pinned[h] += 1
                continue
            if h in newest:  # recorded lately (a hot prefix): moved to the end, nothing else changes
                del newest[h]
            else:
                shard = holders[h & SHARD_MASK]
                held = shard.get(h, 0)
                if held & bit:  # held here since an older generation
                    lru.unlink(h)
                else:
                    # A block held by one endpoint (the common case) shares that endpoint's `bit`
                    # object instead of a fresh int per entry: at slot 255 a mask int is ~60 bytes.
                    shard[h] = held | bit if held else bit
                    added += 1
            if pin:
                pinned[h] = 1
            else:
                newest[h] = None
        lru.size += added
        self._entries += added
        self._settle(endpoint, slot, lru)

    def _settle(self, endpoint: str, slot: int, lru: Generations) -> None:
        """After blocks joined the newest generation: open a new one if it is full, and evict
        what lies beyond the endpoint's capacity."""
        capacity = self._capacity.get(endpoint, self.default_capacity)
        lru.roll(capacity)
        if lru.size > capacity:
            self._evict(endpoint, slot, capacity)

    def forget(self, endpoint: str, hashes: Sequence[int]) -> None:
        """Drop these blocks from `endpoint` (a record that turned out wrong: another endpoint
        served the request)."""
        if self._pending:
            self.flush()
        slot = self._slot.get(endpoint)
        if slot is None or not hashes:
            return
        lru = self._lru[endpoint]
        bit = 1 << slot
        holders = self._holders
        dropped = 0
        pinned = lru.pinned
        for h in dict.fromkeys(hashes):
            if holders[h & SHARD_MASK].get(h, 0) & bit:
                if pinned.pop(h, None) is None:
                    lru.unlink(h)
                clear_bit(holders, h, ~bit)
                dropped += 1
        lru.size -= dropped
        self._entries -= dropped

    def _evict(self, endpoint: str, slot: int, capacity: int) -> None:
        """Drop the least recently used blocks beyond `capacity`; pinned blocks are out of the
        order, and while more are pinned than `capacity`, only the unpinned go."""
        lru = self._lru[endpoint]
        excess = lru.size - max(capacity, len(lru.pinned))
        if excess <= 0:
            return
        clear = ~(1 << slot)
        holders = self._holders
        victims = lru.oldest(excess)
        for h in victims:
            shard = holders[h & SHARD_MASK]
            mask = shard[h] & clear
            if mask:
                shard[h] = mask
            else:
                del shard[h]
        self._entries -= len(victims)

    # -- introspection ---------------------------------------------------------------------
    @property
    def entries(self) -> int:
        """(endpoint, block) pairs held."""
        if self._pending:
            self.flush()
        return self._entries

    @property
    def distinct_blocks(self) -> int:
        if self._pending:
            self.flush()
        return shard_len(self._holders)

    def approx_bytes(self) -> int:
        if self._pending:
            self.flush()
        return self._entries * BYTES_PER_ENTRY

    def held_by(self, endpoint: str) -> int:
        if self._pending:
            self.flush()
        lru = self._lru.get(endpoint)
        return lru.size if lru is not None else 0

    def used_shares(self, endpoints: Sequence[Keyed]) -> list[float]:
        """`used_share` of each endpoint (anything with a `key`), in one loop."""
        if self._pending:
            self.flush()
        lru, capacity, default = self._lru, self._capacity, self.default_capacity
        out = []
        for ep in endpoints:
            key = ep.key
            held = lru.get(key)
            out.append((held.size if held is not None else 0) / capacity.get(key, default))
        return out

    def used_share(self, endpoint: str) -> float:
        """held_by(endpoint) / capacity(endpoint), in one call (read for every candidate)."""
        if self._pending:
            self.flush()
        lru = self._lru.get(endpoint)
        return (lru.size if lru is not None else 0) / self._capacity.get(endpoint, self.default_capacity)
