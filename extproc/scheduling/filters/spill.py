"""hot-spot-spill-filter: keep hot prefixes from piling onto one replica.

An endpoint is dropped from the candidates when

    load(e) > relative * min_load + absolute

where min_load is the lowest load among the candidates (load: extproc/scheduling/load.py).
Defaults relative=1.5, absolute=4 (EppConfig.spill). If that would drop everything (it cannot,
the least loaded always passes) the input is returned unchanged.

Effect: while the cache-warm replica is not much busier than the rest, the prefix scorer keeps
the prefix there. Once it is, requests for that prefix spill to the best remaining replica
(warm ones first, by score); the picker records the prefix for it, so it warms up too and the
hot prefix ends up replicated on as many replicas as its load needs.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.core.datastore import Endpoint
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.load import endpoint_load


class SpillFilter:
    name = "hot-spot-spill-filter"

    def __init__(self, relative: float, absolute: float) -> None:
        if relative < 1.0 or absolute < 0.0:
            raise ValueError("spill thresholds: relative must be >= 1 and absolute >= 0")
        self.relative = relative
        self.absolute = absolute

    def filter(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        if len(endpoints) < 2:
            return list(endpoints)
        loads = [endpoint_load(ep) for ep in endpoints]
        limit = self.relative * min(loads) + self.absolute
        kept = [ep for ep, load in zip(endpoints, loads, strict=True) if load <= limit]
        return kept or list(endpoints)
