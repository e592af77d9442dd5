"""Blocks that requests still running on an endpoint hold: its engine cannot evict them.

vLLM's prefix cache evicts only free blocks (reference count 0), the least recently freed
first: a running request's blocks stay cached however much is stored after them, and a
finished request's blocks join the free queue at its end, so they are the last to go. When an
engine's cache is full of running requests it does not evict them; it queues new requests
instead (a KV-capacity queue). An LRU ordered by routing time alone forgets the oldest running
prompts first: on an endpoint whose running prompts fill its cache (a few long prompts on a
small cache), the prompt of a request still decoding there looked evicted, and the next request
of its group went to a replica with a cold cache while the engine that held it sat one slot away.

So the index (extproc/prefix/index.py) keeps, per endpoint, `Pins`: each block of a request
routed there and not yet ended, with the number of such requests holding it:

- a decision's record pins its blocks (`add`); eviction passes over pinned blocks (they move to
  the most recently used end, and the endpoint may hold more than its capacity while its running
  requests alone exceed it, as the engine does);
- the response's end unpins them (`drop`) and records them again, unannounced to peers: they
  become the most recently used, as the engine's free queue orders them.

Bounded: an endpoint stops pinning once PIN_BOUND times its capacity in distinct blocks are
pinned (a request that would pin beyond is recorded unpinned), so a request whose end is never
reported (an in-process caller that does not complete) leaves at most that bound, plus one
prompt's blocks, behind. Not the capacity itself: the index's capacity is the engine's cache at
the learned bytes per token (extproc/prefix/capacity.py), which is the prior's until measured, and
the engine's running requests share their prefixes' blocks, which a count before the update
cannot see; the engine itself bounds what runs, by queueing.
The cost is a dict update per block at the record and at the end, off the decision's answer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import compress, repeat
from operator import add, not_, sub

PIN_BOUND = 2  # distinct blocks pinned per endpoint, in capacities


class Pins:
    __slots__ = ("counts", "requests")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}  # block hash -> requests in flight holding it
        # id(hashes) -> hashes, for each request pinned here: `drop` unpins only what `add`
        # pinned, and keeping the list alive keeps its id from being reused meanwhile.
        self.requests: dict[int, Sequence[int]] = {}

    def __len__(self) -> int:
        return len(self.counts)

    def __contains__(self, h: object) -> bool:
        return h in self.counts

    def add(self, hashes: Sequence[int], capacity: int) -> None:
        """Pin one request's blocks, unless PIN_BOUND x `capacity` distinct blocks are pinned
        already (or this list is pinned here). Each count in C (map, zip, dict.update): this runs
        for every request, over up to max_prefix_blocks blocks."""
        counts, requests = self.counts, self.requests
        if not hashes or id(hashes) in requests or len(counts) >= PIN_BOUND * capacity:
            return
        requests[id(hashes)] = hashes
        counts.update(zip(hashes, map(add, map(counts.get, hashes, repeat(0)), repeat(1)), strict=True))

    def drop(self, hashes: Sequence[int]) -> bool:
        """Unpin the blocks `add` pinned for this list; whether it had."""
        if self.requests.pop(id(hashes), None) is None:
            return False
        counts = self.counts
        left = list(map(sub, map(counts.__getitem__, hashes), repeat(1)))
        counts.update(zip(hashes, left, strict=True))
        deque(map(counts.pop, compress(hashes, map(not_, left)), repeat(None)), maxlen=0)
        return True
