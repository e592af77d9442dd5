"""The precise prefix index: which (endpoint, rank) holds which block, as its engine reported.

Dual-key structure (llm-d's design, in our own key space, see extproc/kvevents/keys.py):
- `_holders`: our key -> bitmask of slots holding it (one walk answers every candidate), in
  shards (extproc/prefix/shards.py: no update rebuilds millions of entries at once).
- A *confirmed* slot (extproc/kvevents/slots.py) per source (endpoint, data-parallel rank) and
  KV cache tier: our keys in LRU order and the engine's hashes mapped to them, which resolve
  `parent_block_hash` of later `BlockStored` events, `BlockRemoved` and placeholders.
- A *speculative* slot per endpoint: keys predicted at decision time for the chosen endpoint
  (`record_speculative`), each living `speculative_ttl_s` (default 2 s) so back-to-back requests
  with one prefix stick before the engine's events arrive. A `BlockRemoved` drops the key from the
  speculative slot too.

Events (`apply`): `BlockStored` re-hashes `token_ids` from the key its parent maps to (the chain
root for a sequence's first block); a parent unknown on that source (stored before we listened,
or already dropped) makes the event an *orphan*: counted, not indexed. `BlockRemoved` unmaps the
engine hashes. `AllBlocksCleared` empties the source. KV groups (extproc/kvevents/wire.py): only
full-attention groups' stores are indexable; a source indexes the first such group it sees
(`group_idx`) and applies removals of that group only (or of no group, from older publishers).

KV cache tiers (extproc/kvevents/tiers.py): a source's CPU and STORAGE blocks (vLLM's offloading
connector) live in lower-tier slots of their own, each bounded by `default_capacity` (the engine
does not report its offload capacity). A lower-tier `BlockStored` with tokens
(`self_describing_kv_events`) is keyed as on the GPU tier, its parent looked up on any tier of the
source; a *placeholder* (engine hashes alone) is resolved through the source's tiers: the hash maps
to the key its GPU (or a lower) tier announced it under, the same tokens and chain (`resolved`;
unresolved hashes are orphans). Lower tiers count repeated announcements (slots.py). A tier of
weight 0 is not indexed (its events are skipped).

Matching (`match_tiers`; `match` is its runs): without lower-tier slots among the candidates, for
each candidate endpoint the longest run of leading keys held by any one of its slots (max over
ranks and the speculative slot), each block weighing 1. The walk ANDs bitmasks and stops at the
first key nobody holds; once FEW_TO_WALK (2) or fewer slots are left, each walks its own entries.
With lower-tier slots, tiers.py's walk: a source's tiers together hold a run, each block weighed
by the best tier holding it.

Memory: each confirmed slot holds at most its capacity (`set_capacity`, from the engine's
`num_gpu_blocks` when scraped, else `default_capacity`: `--kv-events-index-capacity`, 32768 by
default); beyond it the least recently stored entries go. `BYTES_PER_ENTRY` is measured (tests/kvevents/test_index.py,
tracemalloc, CPython 3.11): a key in `_holders`, `entries` and `engine` plus the engine's hash
int cost 160-230 bytes depending on the dicts' fill; the estimate uses the upper end, i.e. ~7.5 MB
per endpoint rank at the default capacity.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from extproc.config.settings import KVEventsConfig
from extproc.kvevents.keys import chain_keys, key_seed
from extproc.kvevents.slots import Confirmed, Slot, Speculative, evict, hold, release
from extproc.kvevents.tiers import Group, TierMatch, tier_weights, walk
from extproc.kvevents.wire import GPU, TIERS, Cleared, Event, Removed, Stored
from extproc.prefix.generations import leading_in
from extproc.prefix.shards import SHARD_MASK, clear_bit, new_shards

Source = tuple[str, int]  # (endpoint key, data-parallel rank)
BYTES_PER_ENTRY = 230  # measured with tracemalloc, CPython 3.11 (tests/kvevents/test_index.py)
# match walks each slot's own entries once this many or fewer are left: a routed prompt is held
# by its endpoint's confirmed and speculative slots (extproc/prefix/index.py: FEW_TO_WALK).
FEW_TO_WALK = 2


class PreciseIndex:
    def __init__(self, default_capacity: int,
                 speculative_ttl_s: float = KVEventsConfig().speculative_ttl_s,
                 weights: Sequence[tuple[str, float]] = KVEventsConfig().tier_weights) -> None:
        if default_capacity <= 0:
            raise ValueError("capacity must be positive")
        self.default_capacity = default_capacity
        self.speculative_ttl_s = speculative_ttl_s
        self.weights = tier_weights(weights, KVEventsConfig().tier_weights)  # by tier
        self._holders = new_shards()
        self._confirmed: dict[Source, Confirmed] = {}  # the GPU tier's slots
        self._lower: dict[tuple[Source, int], Confirmed] = {}  # (source, tier) -> a CPU or STORAGE slot
        self._lower_bits = 0  # their bits: a match among candidates with none of them is GPU-only
        self._groups: tuple[int, list[Group]] | None = None  # the last tiered match's (slots mask, groups)
        self._speculative: dict[str, Speculative] = {}
        self._slots_of: dict[str, list[Slot]] = {}
        self._owner: dict[int, str] = {}  # bit -> endpoint
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._capacity: dict[str, int] = {}
        self._queue: deque[tuple[float, Speculative, Sequence[int]]] = deque()
        # The last candidate list `match` saw (and as a set), its slots' mask and bit -> slot (as
        # in extproc/prefix/index.py); a slot made for one of them joins it (each endpoint's first
        # routing makes its speculative slot: a pool's first decisions would each rebuild it),
        # and an endpoint removed drops it.
        self._candidates: tuple[list[str], frozenset[str], int, dict[int, Confirmed | Speculative]] | None = None
        self.lora_names: set[str] = set()
        self.last_block_size = 0  # block_size of the latest BlockStored
        self.entries = 0  # confirmed (slot, key) entries, every tier
        self.stored = self.removed = self.orphaned = self.evicted = self.skipped = self.cleared = 0
        self.resolved = 0  # placeholder blocks resolved through the source's tiers

    # -- slots -------------------------------------------------------------------------------
    def _new_bit(self, endpoint: str) -> int:
        bit = self._free_bits.pop() if self._free_bits else self._next_bit
        if bit == self._next_bit:
            self._next_bit += 1
        self._owner[bit] = endpoint
        return bit

    def _confirmed_slot(self, source: Source) -> Confirmed:
        slot = self._confirmed.get(source)
        if slot is None:
            slot = Confirmed(self._new_bit(source[0]), source[0])
            self._confirmed[source] = slot
            self._add_slot(slot)
        return slot

    def _lower_slot(self, source: Source, tier: int) -> Confirmed:
        slot = self._lower.get((source, tier))
        if slot is None:
            slot = Confirmed(self._new_bit(source[0]), source[0], source[1], tier)
            self._lower[(source, tier)] = slot
            self._lower_bits |= 1 << slot.bit
            self._add_slot(slot)
        return slot

    def _tiers_of(self, source: Source) -> list[Confirmed]:
        """The source's slots, GPU first (those that exist)."""
        gpu = self._confirmed.get(source)
        slots = [gpu] if gpu is not None else []
        if self._lower_bits:
            slots.extend(s for t in range(1, len(TIERS)) if (s := self._lower.get((source, t))) is not None)
        return slots

    def _speculative_slot(self, endpoint: str) -> Speculative:
        slot = self._speculative.get(endpoint)
        if slot is None:
            slot = Speculative(self._new_bit(endpoint), endpoint)
            self._speculative[endpoint] = slot
            self._add_slot(slot)
        return slot

    def _add_slot(self, slot: Confirmed | Speculative) -> None:
        self._slots_of.setdefault(slot.endpoint, []).append(slot)
        self._groups = None
        cached = self._candidates
        if cached is not None and slot.endpoint in cached[1]:
            cached[3][slot.bit] = slot
            self._candidates = (cached[0], cached[1], cached[2] | 1 << slot.bit, cached[3])

    def _clear_bit(self, key: int, bit: int) -> None:
        clear_bit(self._holders, key, ~(1 << bit))

    def set_capacity(self, endpoint: str, capacity: int) -> None:
        """Entries per confirmed slot of `endpoint` (e.g. the engine's num_gpu_blocks)."""
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self._capacity[endpoint] = capacity
        for slot in self._slots_of.get(endpoint, ()):
            if isinstance(slot, Confirmed) and slot.tier == GPU:
                self._evict(slot, capacity)

    def capacity(self, endpoint: str) -> int:
        return self._capacity.get(endpoint, self.default_capacity)

    # -- events (subscriber tasks) -----------------------------------------------------------
    def apply(self, source: Source, event: Event) -> int:
        """Apply one decoded event from `source`; returns the blocks it added or removed."""
        if isinstance(event, Stored):
            return self._stored(source, event)
        if isinstance(event, Removed):
            if not event.indexable:
                return 0
            return self._removed(source, event) if event.tier == GPU else self._removed_lower(source, event)
        if isinstance(event, Cleared):
            self.cleared += 1
            self.clear_source(source)
        return 0

    def _stored(self, source: Source, ev: Stored) -> int:
        if not ev.indexable or not self.weights[ev.tier]:
            self.skipped += len(ev.block_hashes)
            return 0
        gpu = self._confirmed_slot(source)
        if ev.group is not None and ev.group != gpu.group:
            if gpu.group is not None:  # a second full-attention group repeats the first's blocks
                self.skipped += len(ev.block_hashes)
                return 0
            gpu.group = ev.group
        slot = gpu if ev.tier == GPU else self._lower_slot(source, ev.tier)
        if ev.placeholder:
            return self._hold(slot, self._resolve(source, ev.block_hashes))
        if ev.parent is None:
            parent = key_seed(ev.lora_name)
        else:
            found = next((k for s in self._tiers_of(source) if (k := s.engine.get(ev.parent)) is not None), None) \
                if ev.tier != GPU else gpu.engine.get(ev.parent)
            if found is None:
                self.orphaned += len(ev.block_hashes)
                return 0
            parent = found
        if ev.lora_name:
            self.lora_names.add(ev.lora_name)
        self.last_block_size = ev.block_size
        try:
            keys = chain_keys(ev.token_ids, ev.block_size, parent)
        except ValueError:
            self.skipped += len(ev.block_hashes)
            return 0
        return self._hold(slot, zip(ev.block_hashes, keys, strict=False))

    def _resolve(self, source: Source, hashes: list[int]) -> list[tuple[int, int]]:
        """(engine hash, our key) of a placeholder's hashes that some tier of the source announced."""
        tiers = self._tiers_of(source)
        pairs = []
        for h in hashes:
            key = next((k for s in tiers if (k := s.engine.get(h)) is not None), None)
            if key is not None:
                pairs.append((h, key))
        self.resolved += len(pairs)
        self.orphaned += len(hashes) - len(pairs)
        return pairs

    def _hold(self, slot: Confirmed, pairs: Iterable[tuple[int, int]]) -> int:
        """Enter (engine hash, key) pairs in a confirmed slot (slots.hold), within its capacity."""
        added = hold(self._holders, slot, pairs)
        self.entries += added
        self.stored += added
        capacity = self.default_capacity if slot.tier != GPU else self._capacity.get(slot.endpoint,
                                                                                      self.default_capacity)
        if len(slot.entries) > capacity:
            self._evict(slot, capacity)
        return added

    def _removed(self, source: Source, ev: Removed) -> int:
        slot = self._confirmed.get(source)
        if slot is None or ev.group not in (None, slot.group if slot.group is not None else 0):
            return 0  # another group's removal (a sliding window moving on) leaves ours resident
        spec = self._speculative.get(source[0])
        entries, engine = slot.entries, slot.engine
        n = 0
        for engine_hash in ev.block_hashes:
            key = engine.pop(engine_hash, None)
            if key is None:
                continue
            if entries.get(key) == engine_hash:
                del entries[key]
                self._clear_bit(key, slot.bit)
                n += 1
            if spec is not None and spec.entries.pop(key, None) is not None:
                self._clear_bit(key, spec.bit)
        self.entries -= n
        self.removed += n
        return n

    def _removed_lower(self, source: Source, ev: Removed) -> int:
        """A CPU or STORAGE removal: one announcement of each hash fewer; gone at the last."""
        slot = self._lower.get((source, ev.tier))
        gpu = self._confirmed.get(source)
        if slot is None or gpu is None or ev.group not in (None, gpu.group if gpu.group is not None else 0):
            return 0
        n = release(self._holders, slot, ev.block_hashes)
        self.entries -= n
        self.removed += n
        return n

    def _evict(self, slot: Confirmed, capacity: int) -> None:
        n = evict(self._holders, slot, capacity)
        self.entries -= n
        self.evicted += n

    def clear_source(self, source: Source) -> None:
        """Forget what one source holds, every tier (cache reset, engine restart, lost events)."""
        for slot in self._tiers_of(source):
            for key in slot.entries:
                self._clear_bit(key, slot.bit)
            self.entries -= len(slot.entries)
            slot.entries = {}
            slot.engine = {}
            slot.refs = {}

    def remove_endpoint(self, endpoint: str) -> None:
        """Purge an endpoint that left the pool: all its ranks and its speculative entries."""
        self._candidates = self._groups = None
        for slot in self._slots_of.pop(endpoint, ()):
            keys: Iterable[int] = slot.entries if isinstance(slot, Confirmed | Speculative) else ()
            for key in keys:
                self._clear_bit(key, slot.bit)
            if isinstance(slot, Confirmed):
                self.entries -= len(slot.entries)
            slot.alive = False
            self._owner.pop(slot.bit, None)
            self._free_bits.append(slot.bit)
            self._lower_bits &= ~(1 << slot.bit)
        for source in [s for s in self._confirmed if s[0] == endpoint]:
            del self._confirmed[source]
        for lower in [s for s in self._lower if s[0][0] == endpoint]:
            del self._lower[lower]
        self._speculative.pop(endpoint, None)
        self._capacity.pop(endpoint, None)

    # -- request path ------------------------------------------------------------------------
    def record_speculative(self, endpoint: str, keys: Sequence[int], now: float) -> None:
        """The request with these keys was just routed to `endpoint`: count them for the TTL."""
        if not keys or self.speculative_ttl_s <= 0:
            return
        slot = self._speculative_slot(endpoint)
        expiry = now + self.speculative_ttl_s
        holders, entries, bit = self._holders, slot.entries, 1 << slot.bit
        for key in keys:
            if entries.pop(key, None) is None:
                shard = holders[key & SHARD_MASK]
                held = shard.get(key)
                shard[key] = bit if held is None else held | bit
            entries[key] = expiry
        self._queue.append((expiry, slot, keys))
        capacity = self.capacity(endpoint)
        if len(entries) > capacity:
            for key in list(entries)[: len(entries) - capacity]:
                del entries[key]
                self._clear_bit(key, slot.bit)

    def expire(self, now: float) -> None:
        """Drop speculative entries whose TTL has passed (cheap when none has)."""
        queue = self._queue
        while queue and queue[0][0] <= now:
            expiry, slot, keys = queue.popleft()
            if not slot.alive:
                continue
            entries = slot.entries
            for key in keys:
                if entries.get(key) == expiry:
                    del entries[key]
                    self._clear_bit(key, slot.bit)

    def next_expiry(self) -> float | None:
        """When the oldest speculative record comes due (clock seconds), None without one."""
        return self._queue[0][0] if self._queue else None

    def held_anywhere(self, key: int) -> bool:
        """Some endpoint holds this block (in its events or as a speculative entry)."""
        return bool(self._holders[key & SHARD_MASK].get(key, 0))

    def match(self, keys: Sequence[int], candidates: Iterable[str], now: float) -> dict[str, int]:
        """Leading keys held per candidate (best slot, or best source over its tiers); candidates
        holding none are omitted."""
        return self.match_tiers(keys, candidates, now).runs

    def match_tiers(self, keys: Sequence[int], candidates: Iterable[str], now: float) -> TierMatch:
        """`match`'s runs, weighed by tier (the module docstring's Matching)."""
        self.expire(now)
        active, by_bit = self._candidate_slots(candidates)
        if active & self._lower_bits and keys:
            holders = self._holders
            return walk(keys, self._tier_groups(active, by_bit),
                        lambda key: holders[key & SHARD_MASK].get(key, 0))
        runs = self._match_runs(keys, active, by_bit)
        return TierMatch(runs, runs, {})

    def _tier_groups(self, active: int, by_bit: dict[int, Confirmed | Speculative]) -> list[Group]:
        """tiers.py's groups of the candidates' slots: a source's tiers together, a speculative slot
        alone; kept while the same slots are asked (a slot made or removed drops them)."""
        kept = self._groups
        if kept is not None and kept[0] == active:
            return kept[1]
        groups: dict[tuple[str, int], Group] = {}
        out = []
        for bit, slot in by_bit.items():
            if isinstance(slot, Speculative):
                g = Group(slot.endpoint)
                g.add(bit, self.weights[GPU], GPU)  # a prediction of what the engine holds on GPU
                out.append(g)
                continue
            found = groups.get((slot.endpoint, slot.rank))
            if found is None:
                found = groups[(slot.endpoint, slot.rank)] = Group(slot.endpoint)
                out.append(found)
            found.add(bit, self.weights[slot.tier], slot.tier)
        self._groups = (active, out)
        return out

    def _match_runs(self, keys: Sequence[int], active: int, by_bit: dict[int, Confirmed | Speculative]) \
            -> dict[str, int]:
        result: dict[str, int] = {}
        if not active or not keys:
            return result
        i = 0
        if active.bit_count() > FEW_TO_WALK:  # many slots: AND their masks key by key
            holders = self._holders
            for i, key in enumerate(keys):
                nxt = holders[key & SHARD_MASK].get(key, 0) & active
                if nxt != active:
                    if i:
                        self._assign(active & ~nxt, i, result)
                    active = nxt
                    if nxt.bit_count() <= FEW_TO_WALK:  # few left, each holding key i
                        break
            else:
                self._assign(active, len(keys), result)
                return result
            i += 1
        # Few slots left: each one's own entries (which hold a key exactly when its bit is set in
        # holders[key]) answer the rest, a small dict instead of the pool-wide one and no mask;
        # an endpoint has its longest run over its slots.
        while active:
            low = active & -active
            slot = by_bit[low.bit_length() - 1]
            matched = i + leading_in(slot.entries, keys, i)
            if matched > result.get(slot.endpoint, 0):
                result[slot.endpoint] = matched
            active ^= low
        return result

    def _candidate_slots(self, candidates: Iterable[str]) -> tuple[int, dict[int, Confirmed | Speculative]]:
        """(mask of the candidates' slots, bit -> slot), reused while the list is the same."""
        listed = candidates if isinstance(candidates, list) else list(candidates)
        cached = self._candidates
        if cached is not None and cached[0] == listed:
            return cached[2], cached[3]
        active = 0
        by_bit: dict[int, Confirmed | Speculative] = {}
        slots_of = self._slots_of
        for ep in listed:
            for slot in slots_of.get(ep, ()):
                if isinstance(slot, Confirmed | Speculative):
                    active |= 1 << slot.bit
                    by_bit[slot.bit] = slot
        self._candidates = (list(listed), frozenset(listed), active, by_bit)
        return active, by_bit

    def _assign(self, mask: int, matched: int, result: dict[str, int]) -> None:
        owner = self._owner
        while mask:
            low = mask & -mask
            ep = owner[low.bit_length() - 1]
            if result.get(ep, 0) < matched:
                result[ep] = matched
            mask ^= low

    # -- introspection -----------------------------------------------------------------------
    def held(self, endpoint: str, tier: int = GPU) -> int:
        """Confirmed entries of an endpoint on one tier, all ranks together."""
        return sum(len(s.entries) for s in self._slots_of.get(endpoint, ())
                   if isinstance(s, Confirmed) and s.tier == tier)

    def speculative(self, endpoint: str) -> int:
        slot = self._speculative.get(endpoint)
        return len(slot.entries) if slot is not None else 0

    def approx_bytes(self) -> int:
        return self.entries * BYTES_PER_ENTRY
