"""queue-scorer: prefer endpoints with a shorter waiting queue (the Go EPP's formula).

q(e) = scraped `vllm:num_requests_waiting` + requests routed to e since that scrape
(`queue_depth` in extproc/scheduling/load.py), so stale scrapes cannot cause bursts onto one pod.

score(e) = (max_q - q(e)) / (max_q - min_q) over the endpoints with usable metrics; 1.0 for all of
them when their queues are equal. An endpoint whose last scrape failed, or is older than
`staleness_s` (--metrics-staleness-threshold, default 2 s), counts as saturated: score 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from extproc.core.datastore import Endpoint
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.load import queue_depth, usable_metrics
from extproc.scheduling.scorers.inflight import min_max_inverse


class QueueScorer:
    name = "queue-scorer"
    approximate_use = "none"  # extproc/scheduling/interfaces.py's Scorer

    def __init__(self, staleness_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.staleness_s = staleness_s
        self._clock = clock

    def score(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> list[float]:
        now = self._clock()
        queues: list[float | None] = []
        for ep in endpoints:
            m = usable_metrics(ep, now, self.staleness_s)
            queues.append(None if m is None else queue_depth(ep, m))
        known = iter(min_max_inverse([q for q in queues if q is not None]))
        return [0.0 if q is None else next(known) for q in queues]
