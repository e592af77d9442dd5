"""The precise index's slots: one engine tier's entries, or one endpoint's predicted ones.

A slot owns one bit of the index's holders masks (extproc/prefix/shards.py): the bit is set for a
key exactly while the slot's `entries` hold it.
- `Confirmed`: what one source (endpoint, data-parallel rank) reported on one KV cache tier.
  `entries` our key -> engine hash in LRU order (insertion order; a re-stored block moves to the
  end), `engine` engine hash -> our key (resolves a later event's parent, removal or placeholder).
  On the CPU and STORAGE tiers `refs` counts the announcements of a hash beyond the first: vLLM's
  offloading connector announces a block once per offloaded chunk covering it, and a block leaves
  at its last removal (`release`). The GPU tier announces a block once until it removes it.
- `Speculative`: keys predicted at decision time for an endpoint, each with its expiry.

`hold`, `release` and `evict` change a confirmed slot and its bit, and return how many entries
came or went; the index keeps the counts and the bounds (extproc/kvevents/index.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from extproc.kvevents.wire import GPU
from extproc.prefix.shards import SHARD_MASK, clear_bit


class Slot:
    __slots__ = ("alive", "bit", "endpoint")

    def __init__(self, bit: int, endpoint: str) -> None:
        self.bit = bit
        self.endpoint = endpoint
        self.alive = True


class Confirmed(Slot):
    __slots__ = ("engine", "entries", "group", "rank", "refs", "tier")

    def __init__(self, bit: int, endpoint: str, rank: int = 0, tier: int = GPU) -> None:
        super().__init__(bit, endpoint)
        self.rank, self.tier = rank, tier
        self.entries: dict[int, int] = {}  # our key -> engine hash, LRU order
        self.engine: dict[int, int] = {}  # engine hash -> our key
        self.refs: dict[int, int] = {}  # lower tiers: engine hash -> announcements, where more than one
        self.group: int | None = None  # the full-attention KV group indexed (the first one stored; GPU slot)


class Speculative(Slot):
    __slots__ = ("entries",)

    def __init__(self, bit: int, endpoint: str) -> None:
        super().__init__(bit, endpoint)
        self.entries: dict[int, float] = {}  # our key -> expiry (clock seconds)


def hold(holders: list[dict[int, int]], slot: Confirmed, pairs: Iterable[tuple[int, int]]) -> int:
    """Enter (engine hash, key) pairs, most recent last; returns the entries new to the slot."""
    entries, engine, refs, bit = slot.entries, slot.engine, slot.refs, 1 << slot.bit
    counted = slot.tier != GPU
    added = 0
    for engine_hash, key in pairs:
        old = entries.pop(key, None)
        if old is None:
            shard = holders[key & SHARD_MASK]
            held = shard.get(key)
            shard[key] = bit if held is None else held | bit
            added += 1
        elif old != engine_hash:
            engine.pop(old, None)
            refs.pop(old, None)
        elif counted:  # announced again (another offloaded chunk covering it)
            refs[engine_hash] = refs.get(engine_hash, 1) + 1
        entries[key] = engine_hash
        engine[engine_hash] = key
    return added


def release(holders: list[dict[int, int]], slot: Confirmed, hashes: Iterable[int]) -> int:
    """A lower tier's removal: one announcement of each hash fewer; returns the entries gone (at the last)."""
    entries, engine, refs, clear = slot.entries, slot.engine, slot.refs, ~(1 << slot.bit)
    n = 0
    for engine_hash in hashes:
        key = engine.get(engine_hash)
        if key is None:
            continue
        count = refs.pop(engine_hash, 1)
        if count > 1:
            refs[engine_hash] = count - 1
            continue
        del engine[engine_hash]
        if entries.get(key) == engine_hash:
            del entries[key]
            clear_bit(holders, key, clear)
            n += 1
    return n


def evict(holders: list[dict[int, int]], slot: Confirmed, capacity: int) -> int:
    """Drop the least recently stored entries beyond `capacity`; returns how many went."""
    excess = len(slot.entries) - capacity
    if excess <= 0:
        return 0
    victims = []
    for key in slot.entries:
        victims.append(key)
        if len(victims) >= excess:
            break
    clear = ~(1 << slot.bit)
    for key in victims:
        engine_hash = slot.entries.pop(key)
        slot.engine.pop(engine_hash, None)
        slot.refs.pop(engine_hash, None)
        clear_bit(holders, key, clear)
    return len(victims)
