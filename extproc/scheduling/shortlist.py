"""Which candidates a decision scores in a large pool (--max-scored-endpoints, default 32).

Scoring an endpoint in Python costs microseconds (predicted-ttft-scorer: its drained backlog,
load, slot wait, cache fullness and eviction terms; bench/results/scale-parts.md), so at 256
endpoints, every candidate scored, the scorers were three quarters of a request's CPU
(docs/scale.md). Above `limit` candidates the scheduler scores
a shortlist of at most `limit` of them instead:

1. every candidate holding part of the prompt in the approximate or the precise index, or the
   request's affinity key: only there can a hit lower the cost. The longest matches first and,
   among equal matches, the least loaded (the holders a hot prefix's bounded reuse still
   admits), at most limit / 2 of them;
2. the least-waiting quarter of `limit`: ranked by what a prompt held whole would wait there
   (a `QueueRanker` scorer's; predicted-ttft-scorer's prediction for 0 uncached tokens, every
   new scrape applied on the way, kept between decisions where nothing changed:
   extproc/scheduling/queue_ranking.py, which keeps them sorted: `least_waiting`), by load
   (extproc/scheduling/load.py, sorted at each decision) without one; ties broken at random so
   that equal ones do not favour the pool's first endpoints. On a busy pool these are what a cold prompt
   needs; a count of requests alone misses how much prefill each one queues (ranked by it, a
   shortlist of 32 of 64 simulated replicas had a worse TTFT tail than scoring all 64; ranked
   by the queue, level);
3. a uniform random sample of the rest up to `limit`: the endpoints the ranking misranks
   (an emptier cache, fewer prefixes to evict, a slot free sooner) compete as in
   power-of-d-choices load balancing, where the best of d random choices already keeps the
   busiest replica's excess at O(log log n / log d).

The request keeps the whole pool (`pool`, `pool_loads`) so that pool-wide quantities (the mean
load of the reuse and new-prompt bounds, the endpoints whose state is kept) stay the pool's, not
the shortlist's. What remains per request in the pool size: the index lookup over the candidate
set, the candidates' keys and a sum of the pool's loads for its mean, in C (all far cheaper than
scoring); the ranking's changes and its 20 ms refresh of the endpoints whose queue moves with
time (queue_ranking.py), the least-waiting quarter, the holders' positions and the sample cost
what they hold, not the pool's size.

Weighted profiles' min-max normalised scorers (queue, in-flight) then normalise over the
shortlist; without a ranker the least-loaded quarter keeps the pool's minimum in it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from extproc.config.settings import MIN_SCORED_ENDPOINTS
from extproc.core.datastore import Endpoint
from extproc.scheduling.draws import draw_into
from extproc.scheduling.interfaces import QueueRanker, SchedulingRequest
from extproc.scheduling.load import endpoint_load


class Shortlist:
    def __init__(self, limit: int, rng: random.Random | None = None) -> None:
        if limit < 0 or 0 < limit < MIN_SCORED_ENDPOINTS:
            raise ValueError(f"max_scored_endpoints must be 0 (every candidate) or at least {MIN_SCORED_ENDPOINTS}")
        self.limit = limit
        self._rng = rng or random.Random()
        self._keys: list[str] = []  # the last pool's keys, and key -> position in it
        self._where: dict[str, int] = {}

    def applies(self, candidates: int) -> bool:
        return 0 < self.limit < candidates

    def select(self, request: SchedulingRequest, endpoints: Sequence[Endpoint],
               keys: Sequence[str], ranker: QueueRanker | None = None) -> list[Endpoint]:
        """The candidates to score, in pool order; sets request.pool and request.pool_loads.
        `keys`: the endpoints' keys (the scheduler has them for the index lookup); `ranker`:
        ranks the least-waiting quarter (by load without one)."""
        n, limit, rng = len(endpoints), self.limit, self._rng
        if ranker is not None:
            loads, waits = ranker.queue_costs(endpoints, keys)
        else:
            loads = waits = list(map(endpoint_load, endpoints))
        request.pool, request.pool_loads = endpoints, loads
        chosen: set[int] = set()
        held = request.prefix_match.keys() | request.precise_match.keys() | request.affinity_match
        if held:
            if keys != self._keys:  # another pool (the same one compares its strings by identity, in C)
                self._keys = list(keys)
                self._where = {k: i for i, k in enumerate(self._keys)}
            where = self._where
            at = [where[k] for k in held]
            prefix, precise = request.prefix_match, request.precise_match
            # Blocks of either index (bytes or tokens: a ranking, not a measure), then the load.
            at.sort(key=lambda i: (-max(prefix.get(keys[i], 0), precise.get(keys[i], 0)), loads[i]))
            chosen.update(at[:limit // 2])
        if ranker is not None:
            chosen.update(ranker.least_waiting(limit // 4, rng))
        else:
            start = rng.randrange(n)
            order = [*range(start, n), *range(start)]
            order.sort(key=waits.__getitem__)  # stable: equal waits stay in the rotated order
            chosen.update(order[:limit // 4])
        draw_into(chosen, n, limit, rng)
        return [endpoints[i] for i in sorted(chosen)]
