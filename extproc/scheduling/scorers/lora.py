"""lora-affinity-scorer: prefer endpoints that already serve the request's LoRA adapter.

From `vllm:lora_requests_info` (the newest series: running_lora_adapters, waiting_lora_adapters,
max_lora), for the request's model name m (the Go EPP's scores):
- 1.0  m is among the running adapters;
- 0.8  the endpoint has a free adapter slot (len(running) + len(waiting) < max_lora);
- 0.6  m is among the waiting adapters;
- 0.0  otherwise, and for an endpoint whose last scrape failed or is older than `staleness_s`.
Requests for the base model score 0.8 on endpoints with free slots and 0 elsewhere, so in a pool
without LoRA (max_lora 0) every endpoint scores 0 and the scorer is neutral.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from extproc.core.datastore import Endpoint
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.load import usable_metrics

ACTIVE = 1.0
FREE_SLOT = 0.8
WAITING = 0.6


class LoraAffinityScorer:
    name = "lora-affinity-scorer"
    approximate_use = "none"  # extproc/scheduling/interfaces.py's Scorer

    def __init__(self, staleness_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.staleness_s = staleness_s
        self._clock = clock

    def score(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> list[float]:
        now = self._clock()
        model = request.model
        out = []
        for ep in endpoints:
            m = usable_metrics(ep, now, self.staleness_s)
            if m is None:
                out.append(0.0)
            elif model in m.running_loras:
                out.append(ACTIVE)
            elif len(m.running_loras) + len(m.waiting_loras) < m.max_lora:
                out.append(FREE_SLOT)
            elif model in m.waiting_loras:
                out.append(WAITING)
            else:
                out.append(0.0)
        return out
