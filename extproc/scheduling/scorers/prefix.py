"""prefix-cache-scorer: the share of the request's prompt blocks an endpoint probably holds.

score(e) = matched_blocks(e) / total_blocks, where matched_blocks is the longest run of leading
blocks found for e in the prefix index (filled into `request.prefix_match` by the scheduler).
0 for every endpoint when the prompt has no blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.datastore import Endpoint
from extproc.scheduling.interfaces import SchedulingRequest


class PrefixScorer:
    name = "prefix-cache-scorer"

    def score(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> list[float]:
        total = request.total_blocks
        if total == 0 or not request.prefix_match:
            return [0.0] * len(endpoints)
        match = request.prefix_match
        return [match.get(ep.key, 0) / total for ep in endpoints]
