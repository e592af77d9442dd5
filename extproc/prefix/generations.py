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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from itertools import chain, compress, islice, repeat
from operator import indexOf, is_

GENERATIONS = 4
MIN_GEN = 256
MAX_GENS = GENERATIONS + 4
_MISSING = object()  # what dict.pop returns for a block a generation does not hold


class Generations:
    __slots__ = ("gens", "size")

    def __init__(self) -> None:
        self.gens: deque[dict[int, None]] = deque([{}])
        self.size = 0  # blocks held, over all generations

    def __iter__(self) -> Iterator[int]:
        """Oldest first."""
        return chain.from_iterable(self.gens)

    def leading(self, hashes: Sequence[int], start: int) -> int:
        """How many of `hashes`, from `hashes[start]` on, are held here before the first that is
        not: each generation walks in C from where the run stands (prefix/index.py's leading_in)
        until none takes it further. A prompt's blocks were recorded together, so the run mostly
        lies in one or two generations."""
        n = len(hashes)
        i = start
        moved = True
        while moved and i < n:
            moved = False
            for g in reversed(self.gens):
                try:
                    j = i + indexOf(map(g.__contains__, islice(hashes, i, None)), False)
                except ValueError:
                    return n - start
                if j > i:
                    i, moved = j, True
        return i - start

    def unlink(self, h: int) -> None:
        """Delete `h` (held here) from the generation holding it."""
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

    def touch(self, blocks: dict[int, None]) -> int:
        """Move `blocks` (oldest first) to the newest end; how many of them were held here.
        Each generation from the newest deletes, in C, those not found in a newer one (a block
        used lately mostly is in the newest). Where fewer than all were held, none is put back
        (they are out of the order and of `size`): the caller puts back those it knows are held."""
        gens = self.gens
        rest: list[int] | dict[int, None] = blocks
        emptied = False
        for k in range(len(gens) - 1, -1, -1):
            g = gens[k]
            rest = list(compress(rest, map(is_, map(g.pop, rest, repeat(_MISSING)), repeat(_MISSING))))
            if not g and k != len(gens) - 1:
                emptied = True
            if not rest:
                break
        if emptied:
            self.gens = gens = deque([*(g for g in islice(gens, len(gens) - 1) if g), gens[-1]])
        held = len(blocks) - len(rest)
        if not rest:
            gens[-1].update(blocks)
        else:
            self.size -= held
        return held

    def keep(self, hashes: Sequence[int]) -> None:
        """Put back blocks `oldest` took (pinned ones) as the most recently used."""
        self.gens[-1].update(dict.fromkeys(hashes))
        self.size += len(hashes)

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
