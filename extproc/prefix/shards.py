"""A block-hash -> holders map kept in SHARDS dicts, so that no update rebuilds millions of entries.

A CPython dict that keeps losing old keys and gaining new ones (an index at capacity: every
record evicts) leaves a dummy for each deleted key; once its free slots run out, the insert that
finds none rebuilds the whole table, on the event loop, in time proportional to its live
entries: about two seconds for the 8M entries of 256 endpoints at the default capacity, every
few thousand requests (bench/scale_stalls.py, results in bench/results/scale.md). Split by the
hash's low bits into SHARDS (1,024) dicts, a rebuild touches one shard, 1/1,024 of the entries
(7.8k at 8M), and the shards' rebuilds fall at different times. The price is locality: one dict
keeps a record's blocks side by side in its entry table (inserted together, evicted together),
the shards scatter them, which makes a record dearer (the same bench reports both), the more so
the more shards. 1,024, not 256: at 256 endpoints 256 shards of 31k entries still paused an
update for 10-16 ms at their rebuilds; 4,096 made every record dearer still. The hashes are
xxh64 (approximate index) or our own chained keys (precise index, extproc/kvevents/keys.py):
uniform in their low bits.

Callers inline the lookup, `shards[h & SHARD_MASK].get(h, 0)`, rather than call a method per block.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

SHARD_BITS = 10
SHARDS = 1 << SHARD_BITS
SHARD_MASK = SHARDS - 1


def new_shards() -> list[dict[int, int]]:
    return [{} for _ in range(SHARDS)]


def shard_items(shards: list[dict[int, int]]) -> Iterator[tuple[int, int]]:
    for shard in shards:
        yield from shard.items()


def shard_len(shards: list[dict[int, int]]) -> int:
    return sum(len(shard) for shard in shards)


def clear_bit(shards: list[dict[int, int]], h: int, clear: int) -> None:
    """Mask `h`'s holders with `clear` (~bit); the entry goes when no holder is left."""
    shard = shards[h & SHARD_MASK]
    mask = shard.get(h, 0) & clear
    if mask:
        shard[h] = mask
    else:
        shard.pop(h, None)


def first_short(shards: list[dict[int, int]], hashes: Sequence[int], start: int, active: int) -> int:
    """The first of `hashes` from `start` on whose holders do not include all of the mask
    `active` (len(hashes) if none), for a chain along which the holders only shrink
    (extproc/prefix/index.py, "Prefix-closed"): probes at start, start + 1, start + 3, ...
    (doubling steps) until one is short, then a bisection between the last held and it; about
    2 log2(run) lookups for a run held by all, where a walk takes one per block."""
    lo, hi, step = start, len(hashes), 1  # blocks [start, lo) held by all; hi: short, or the end
    while lo < hi:
        probe = min(lo + step - 1, hi - 1)
        h = hashes[probe]
        if shards[h & SHARD_MASK].get(h, 0) & active == active:
            lo = probe + 1
            step *= 2
        else:
            hi = probe
            break
    while lo < hi:
        mid = (lo + hi) // 2
        h = hashes[mid]
        if shards[h & SHARD_MASK].get(h, 0) & active == active:
            lo = mid + 1
        else:
            hi = mid
    return lo
