"""Bounded reuse: a prefix hot on an overloaded endpoint spreads to other replicas.

Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018; Envoy's ring-hash
`hash_balance_factor`), applied to the requests that make a replica hot rather than to all. A
request's reuse key on endpoint e is the last block it would reuse there (its matched prefix on
e: the last matched block hash of the approximate index, or the last matched token key of the
precise one); requests with the same key on e share that prefix there. With n candidates whose
loads sum to L (extproc/scheduling/load.py), the request about to be placed included:

    bound    = ceil(factor x (L + 1) / n)
    over(e)  <=>  inflight(e, key(e)) > slack  and  load(e) + 1 > bound

i.e. more than `slack` requests already reuse this prefix on e, and e would carry more than
`factor` times the pool's mean load. predicted-ttft-scorer credits no cached tokens where the
request is over: there it costs what a cold replica costs, so it goes to the best other
candidate (a replica that holds the prefix and has room first, else a cold one by its queue),
which then holds the prefix too. A prefix whose requests would pile more than its share onto
one replica is so spread over as many replicas as its load needs, each copy paid with one
prefill.

Why only the hot prefix's requests, not every request on the busy endpoint (the filter form):
the other prefixes whose home happens to be there would move too, and each such move is a cache
miss, while the prefix that causes the pile keeps its place. Why the endpoint's whole load, not
the prefix's count alone: a replica that also homes other prefixes saturates (a decode-bound
engine's sequence slots) before the hot prefix alone reaches a per-prefix bound. A multi-turn
follow-up's key is the last block of its own history, so a conversation is never counted as hot;
a system prompt shared by concurrent requests with their own questions (every one's key is the
system prompt's last block) is.

`slack` (2 by default) is how many concurrent requests of one prefix on one replica are still
ordinary: a few requests of one shared system prompt often overlap, and each one turned away is a
cache miss; a prefix that carries a large share of the pool's traffic has many more.

Only requests that reuse something are counted (the first request of a prefix has no key); their
count is released when the response ends, and moved when a fallback served the request instead.
With several active-active pickers each counts only the requests it routed itself, while the
loads include the scraped queues of all: a prefix hot across the pool becomes hot in each
picker's count later (after slack + 1 of its own), and the endpoint bound is the pool's.
factor 0 turns the bound off.
"""

from __future__ import annotations

import math

MAX_KEYS = 65536  # (endpoint, key) pairs counted at most; each is released with its request


def load_bound(total_load: float, n: float, factor: float, weight: float = 1.0) -> float:
    """The most requests an endpoint may hold, the one being placed included: ceil(factor x mean)
    for n endpoints alike; for one of `weight` in a pool whose weights sum to `n`,
    ceil(factor x (L + 1) x weight / n)."""
    return float(math.ceil(factor * (total_load + 1.0) * weight / n - 1e-9))


def over_load(load: float, bound: float) -> bool:
    """The endpoint would hold more than `bound` requests with the one being placed."""
    return load + 1.0 > bound


def over_bound(reusing: int, load: float, bound: float, slack: float) -> bool:
    """More than `slack` requests reuse the prefix there, and the endpoint is over its bound."""
    return reusing > slack and over_load(load, bound)


class ReuseCounts:
    """In-flight requests per (endpoint, reuse key)."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[tuple[str, int], int] = {}

    def __len__(self) -> int:
        return len(self._counts)

    def get(self, endpoint: str, key: int) -> int:
        return self._counts.get((endpoint, key), 0)

    def acquire(self, endpoint: str, key: int) -> bool:
        """Count one more request; False (not counted) once MAX_KEYS pairs are held."""
        k = (endpoint, key)
        counts = self._counts
        n = counts.get(k)
        if n is None:
            if len(counts) >= MAX_KEYS:
                return False
            counts[k] = 1
        else:
            counts[k] = n + 1
        return True

    def release(self, endpoint: str, key: int) -> None:
        k = (endpoint, key)
        n = self._counts.get(k, 0)
        if n > 1:
            self._counts[k] = n - 1
        else:
            self._counts.pop(k, None)
