"""cache-aware-scorer: sglang-router's cache_aware policy, the reference our scheduling is compared with.

`--scheduler cache-aware` runs it alone (weight 1) before max-score-picker, on the candidates the
director and the profile's filters leave, as every profile's scorers. Load is the requests this
picker has in flight on an endpoint (`Endpoint.inflight`: counted when a request is routed there,
released at its response's end); no scraped metric is read. Per request:

1. Imbalanced, when max - min load > balance_abs AND max > balance_rel x min
   (`--balance-abs-threshold` 64, `--balance-rel-threshold` 1.5): the least loaded endpoint,
   whatever it holds.
2. Else the longest prefix match in the approximate index (extproc/prefix/index.py, which the
   scheduler reads into `request.prefix_match`: leading blocks recorded per endpoint). If it
   covers more than cache_threshold of the prompt (matched blocks / prompt blocks >
   `--cache-threshold` 0.3), the endpoint holding it; of several holding it, the least loaded.
3. Else (a miss) the least loaded endpoint.

Equally loaded endpoints tie and the picker draws among them. In every case the scheduler records
the prompt's blocks for the chosen endpoint, as sglang inserts the text into the chosen worker's
tree in both branches. The scores encode that order, so with `--max-endpoints` > 1 the chosen
endpoint comes first and the rest follow by load (the other holders of the match first):

    score(e) = (2 x [e holds the longest match, case 2] + inverse_load(e)) / 3

inverse_load being the min-max normalised load (1 for the least loaded, scorers/inflight.py): a
holder scores at least 2/3, any other endpoint at most 1/3.

Where it differs from sglang-router (its sgl-router/src/policies/cache_aware.rs, CLI defaults):
- the match is on the prompt's 64-byte blocks (extproc/prefix/hashing.py, at most
  `--prefix-max-blocks`), not on characters in a radix tree of the text;
- of several workers holding the longest match sglang takes the first its tree node lists (in
  effect arbitrary), here the least loaded;
- its tree keeps up to max_tree_size characters per worker, pruned of LRU leaves every
  eviction interval; the index keeps up to `--prefix-lru-capacity` blocks per endpoint (tuned to
  the engine's KV cache where scraped), evicts at once, and a running request's blocks last;
- it measures imbalance over every worker, healthy or not; here over the candidates (all of
  them also where only a shortlist is scored, `--max-scored-endpoints`).
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.config.settings import CacheAwareConfig
from extproc.core.datastore import Endpoint
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.scorers.inflight import min_max_inverse


class CacheAwareScorer:
    name = "cache-aware-scorer"
    approximate_use = "all"  # extproc/scheduling/interfaces.py's Scorer

    def __init__(self, config: CacheAwareConfig) -> None:
        if not 0.0 <= config.cache_threshold <= 1.0 or config.balance_abs < 0 or config.balance_rel < 1.0:
            raise ValueError("cache-aware: cache threshold in [0, 1], balance thresholds abs >= 0 and rel >= 1")
        self.cache_threshold = config.cache_threshold
        self.balance_abs = config.balance_abs
        self.balance_rel = config.balance_rel

    def imbalanced(self, loads: Sequence[int]) -> bool:
        lo, hi = min(loads), max(loads)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo

    def holders(self, request: SchedulingRequest) -> frozenset[str]:
        """The endpoints holding the longest prefix match, if it covers more than cache_threshold."""
        match = request.prefix_match
        if not match or not request.total_blocks:
            return frozenset()
        longest = max(match.values())
        if longest / request.total_blocks <= self.cache_threshold:
            return frozenset()
        return frozenset(key for key, blocks in match.items() if blocks == longest)

    def score(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> list[float]:
        if not endpoints:
            return []
        loads = [ep.inflight for ep in endpoints]
        pool = [ep.inflight for ep in request.pool] if request.pool else loads
        holders = frozenset() if self.imbalanced(pool) else self.holders(request)
        return [(2.0 * (ep.key in holders) + x) / 3.0 for ep, x in zip(endpoints, min_max_inverse(loads), strict=True)]
