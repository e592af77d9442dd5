"""inflight-load-scorer: prefer endpoints with less load (see extproc/scheduling/load.py).

score(e) = (max_load - load(e)) / (max_load - min_load) over the candidates, the Go EPP's
queue-scorer normalisation; 1.0 for all when every candidate carries the same load.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.core.datastore import Endpoint
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.load import endpoint_load


def min_max_inverse(values: Sequence[float]) -> list[float]:
    """(max - v) / (max - min) per value; 1.0 for all when max == min."""
    if not values:
        return []
    lo = min(values)
    hi = max(values)
    if hi == lo:
        return [1.0] * len(values)
    span = hi - lo
    return [(hi - v) / span for v in values]


class InflightLoadScorer:
    name = "inflight-load-scorer"
    approximate_use = "none"  # extproc/scheduling/interfaces.py's Scorer

    def score(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> list[float]:
        return min_max_inverse([endpoint_load(ep) for ep in endpoints])
