"""kv-cache-utilization-scorer: prefer endpoints with free KV cache (the Go EPP's formula).

score(e) = 1 - `vllm:kv_cache_usage_perc` (a 0..1 fraction), clamped to [0, 1]. An endpoint
whose last scrape failed, or is older than `staleness_s` (--metrics-staleness-threshold, default
2 s), counts as saturated: score 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from extproc.core.datastore import Endpoint
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.load import usable_metrics


class KvCacheScorer:
    name = "kv-cache-utilization-scorer"
    approximate_use = "none"  # extproc/scheduling/interfaces.py's Scorer

    def __init__(self, staleness_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.staleness_s = staleness_s
        self._clock = clock

    def score(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> list[float]:
        now = self._clock()
        out = []
        for ep in endpoints:
            m = usable_metrics(ep, now, self.staleness_s)
            out.append(0.0 if m is None else min(max(1.0 - m.kv_usage, 0.0), 1.0))
        return out
