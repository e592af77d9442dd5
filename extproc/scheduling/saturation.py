"""utilization-detector: is the pool saturated? Sheddable requests are refused while it is.

Per endpoint (the Go EPP's formula):

    s(e) = max(q(e) / queueDepthThreshold, kv(e) / kvCacheUtilThreshold)

where q(e) is the scraped waiting queue plus the requests routed there since that scrape
(extproc/scheduling/load.py) and kv(e) is `vllm:kv_cache_usage_perc`. Metrics that are missing,
failed, or older than metricsStalenessThreshold count as s(e) = 1.0. Pool saturation is the
average of s(e) over the candidates; no candidates -> 1.0 (fail closed).

Admission (the director's `admission` hook, as the Go EPP without flow control): a request with
priority < 0 (sheddable, from its InferenceObjective) gets 429 (RESOURCE_EXHAUSTED) while the pool
saturation is >= 1 + headroom; every other request passes.

As a filter (when a scheduling profile references the detector): drops endpoints with stale
metrics or s(e) >= 1 + headroom; if that would drop all, all are kept.

Defaults (EppConfig.saturation): queueDepthThreshold 5, kvCacheUtilThreshold 0.8,
metricsStalenessThreshold 200 ms, headroom 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from extproc.config.settings import SaturationConfig
from extproc.core.datastore import Endpoint
from extproc.core.errors import EppError, ErrorCode
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.load import queue_depth, usable_metrics


class UtilizationDetector:
    name = "utilization-detector"

    def __init__(self, config: SaturationConfig, clock: Callable[[], float] = time.monotonic) -> None:
        if config.queue_depth_threshold <= 0 or not 0 < config.kv_cache_util_threshold <= 1:
            raise ValueError("utilization-detector: queueDepthThreshold must be > 0 and "
                             "kvCacheUtilThreshold in (0, 1]")
        if config.metrics_staleness_threshold_s <= 0 or config.headroom < 0:
            raise ValueError("utilization-detector: metricsStalenessThreshold must be > 0 and headroom >= 0")
        self.config = config
        self._clock = clock

    def endpoint_saturation(self, ep: Endpoint, now: float) -> float:
        c = self.config
        m = usable_metrics(ep, now, c.metrics_staleness_threshold_s)
        if m is None:
            return 1.0
        return max(queue_depth(ep, m) / c.queue_depth_threshold, m.kv_usage / c.kv_cache_util_threshold)

    def has_room(self, endpoint: Endpoint) -> bool:
        """Below its own saturation (flow control's dispatch: extproc/flowcontrol/detectors.py)."""
        return self.endpoint_saturation(endpoint, self._clock()) < 1.0

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        if not endpoints:
            return 1.0
        now = self._clock()
        return sum(self.endpoint_saturation(ep, now) for ep in endpoints) / len(endpoints)

    def admit(self, request: SchedulingRequest, candidates: Sequence[Endpoint]) -> None:
        """Raise 429 for a sheddable request while the candidates are saturated."""
        if request.priority < 0 and self.saturation(candidates) >= 1.0 + self.config.headroom:
            raise EppError(ErrorCode.RESOURCE_EXHAUSTED, "the pool is saturated; sheddable request rejected")

    def filter(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        now = self._clock()
        limit = 1.0 + self.config.headroom
        staleness = self.config.metrics_staleness_threshold_s
        kept = [ep for ep in endpoints
                if usable_metrics(ep, now, staleness) is not None and self.endpoint_saturation(ep, now) < limit]
        return kept or list(endpoints)
