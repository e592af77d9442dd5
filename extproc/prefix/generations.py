"""One endpoint's blocks in least-recently-used order, kept in generations of bounded size.

A single insertion-ordered dict is an exact LRU (re-recording a block deletes and re-inserts it),
but at capacity every record deletes as many old keys as it inserts, and the dict then rebuilds
its whole table each time its free slots run out: several milliseconds at 31,250 blocks, the
default capacity, once in ~100 records of an 8k-token prompt, on the event loop
(bench/scale_stalls.py). Here the
order lives in a deque of dicts, oldest first:

- the newest generation takes every recorded block; once it holds `gen_size`
  (capacity / GENERATIONS, at least MIN_GEN; 7,812 at the default capacity) blocks a new empty
  one opens;
- a block recorded again moves to the newest generation: deleted where it was (found by looking
  in the generations from the newest, where a block used again mostly is), re-inserted last;
- eviction takes blocks from the front of the oldest generation, which is dropped once empty.

Only the newest generation grows, so only it is ever rebuilt, and it is at most gen_size plus
one prompt's blocks (a snapshot's `load` fills one generation with all it restores, at start).
GENERATIONS is 4, not more: a block recorded again that is not in the newest generation is
looked for in each older one, a cache miss per generation (in bench/scale_stalls.py's churn at
256 endpoints, 16 generations made a record over a tenth of a millisecond dearer than 4).
Closed generations only lose keys, which a dict does without rebuilding; a closed generation
that blocks keep leaving holds its table until it is evicted or, once more than MAX_GENS are
open, merged with its neighbour into one fresh dict (the two oldest), which bounds both the
deque's length and the memory that emptied tables keep. The order is exact: the generations
concatenated are the single dict's order.

Whether the endpoint holds a block at all is answered by the pool-wide holders map
(extproc/prefix/shards.py), one lookup; a generation is searched only for a block known held.

Pinned blocks: those of requests still running on the endpoint, out of the order. vLLM's prefix
cache evicts only free blocks (reference count 0), the least recently freed first: a running
request's blocks stay cached however much is stored after them, and a finished request's blocks
join the free queue at its end, so they are the last to go; an engine whose cache its running
requests fill queues new requests rather than evicting them. An order by routing time alone
forgot the oldest running prompts first: on an endpoint whose running prompts fill its cache (a
few long prompts on a small cache), the prompt of a request still decoding there looked
evicted, and the next request of its group went to a replica with a cold cache. So, as the
engine keeps its in-use blocks apart from its free queue, `pinned` maps each block a running
request recorded here (`insert` with pin) to the number of such requests; eviction (`oldest`)
never sees them, and `unpin`, at a request's end, puts the blocks no other request holds back
as the most recently used, in C. `size` counts both; PrefixIndex evicts down to its capacity or
to the pinned count, whichever is larger (the engine, too, holds what runs, and queues).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterator, Sequence
from itertools import chain, compress, islice, repeat
from operator import eq, gt, indexOf, sub


def leading_in(held: Container[int], keys: Sequence[int], start: int = 0) -> int:
    """How many of `keys`, from `keys[start]` on, are in `held` before the first that is not
    (the walk in C: it stops at that miss)."""
    try:
        return indexOf(map(held.__contains__, islice(keys, start, None)), False)
    except ValueError:
        return max(len(keys) - start, 0)


GENERATIONS = 4
MIN_GEN = 256
MAX_GENS = GENERATIONS + 4
PIN_BOUND = 2  # distinct blocks pinned per endpoint at most, in capacities (PrefixIndex._record)


class Generations:
    __slots__ = ("gens", "pinned", "size")

    def __init__(self) -> None:
        self.gens: deque[dict[int, None]] = deque([{}])
        self.pinned: dict[int, int] = {}  # block -> running requests holding it, out of the order
        self.size = 0  # blocks held, in the generations and pinned

    def __iter__(self) -> Iterator[int]:
        """Oldest first; the pinned last (in use)."""
        return chain(chain.from_iterable(self.gens), self.pinned)

    def leading(self, hashes: Sequence[int], start: int) -> int:
        """How many of `hashes`, from `hashes[start]` on, are held here before the first that is
        not: each generation walks in C from where the run stands (as leading_in)
        until none takes it further. A prompt's blocks were recorded together, so the run mostly
        lies in one or two generations."""
        n = len(hashes)
        i = start
        moved = True
        # The pinned first (a running request's blocks, most likely asked again), then newest first.
        held: list[Container[int]] = [self.pinned, *reversed(self.gens)] if self.pinned else [*reversed(self.gens)]
        while moved and i < n:
            moved = False
            for g in held:
                try:
                    j = i + indexOf(map(g.__contains__, islice(hashes, i, None)), False)
                except ValueError:
                    return n - start
                if j > i:
                    i, moved = j, True
        return i - start

    def unlink(self, h: int) -> None:
        """Delete `h` (held here, not pinned) from the generation holding it."""
        gens = self.gens
        for k in range(len(gens) - 1, -1, -1):
            g = gens[k]
            if h in g:
                del g[h]
                if not g and k != len(gens) - 1:
                    del gens[k]
                return

    def roll(self, capacity: int) -> None:
        """Open a new generation once the newest is full; merge the two oldest once too many are open."""
        gens = self.gens
        if len(gens[-1]) < max(MIN_GEN, capacity // GENERATIONS):
            return
        gens.append({})
        if len(gens) > MAX_GENS:
            oldest = gens.popleft()
            gens[0] = dict.fromkeys(chain(oldest, gens[0]))

    def unpin(self, ordered: Sequence[int]) -> None:
        """One running request ended: unpin its blocks (`ordered`, as it recorded them, the least
        recently used first); those no other request holds go back as the most recently used.
        Each step over the blocks in C; a block no longer pinned (forgotten since) is left out."""
        pinned = self.pinned
        counts = list(map(pinned.get, ordered, repeat(0)))
        freed = dict.fromkeys(compress(ordered, map(eq, counts, repeat(1))))
        if len(freed) < len(counts):  # some held by another request too, or gone
            pinned.update(compress(zip(ordered, map(sub, counts, repeat(1)), strict=True),
                                   map(gt, counts, repeat(1))))
        deque(map(pinned.pop, freed), maxlen=0)
        self.gens[-1].update(freed)

    def oldest(self, n: int) -> list[int]:
        """Remove and return the `n` least recently recorded blocks (fewer if fewer are held)."""
        gens = self.gens
        victims: list[int] = []
        while len(victims) < n:
            g = gens[0]
            taken = list(islice(g, n - len(victims)))
            for h in taken:
                del g[h]
            victims += taken
            if g:
                break
            if len(gens) == 1:
                break
            gens.popleft()
        self.size -= len(victims)
        return victims
