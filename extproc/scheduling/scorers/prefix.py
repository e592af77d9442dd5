"""prefix-cache-scorer: the share of the request's prompt blocks an endpoint probably holds.

score(e) = matched_blocks(e) / total_blocks, where matched_blocks is the longest run of leading
blocks found for e in the prefix index (filled into `request.prefix_match` by the scheduler).
0 for every endpoint when the prompt has no blocks.

With an affinity hint (`request.affinity_hash` set) the key counts as one more leading block,
held by the endpoints in `request.affinity_match`:

    score(e) = (matched_blocks(e) + [e in affinity_match]) / (total_blocks + 1)

A full hit on an endpoint that also recorded the key stays 1.0; an endpoint that only recorded the
key gets 1 / (total_blocks + 1), a small edge that decides between endpoints otherwise equal
(e.g. two turns of one conversation whose prompts diverge early); the prompt's own blocks still
dominate. Requests without a hint score exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.core.datastore import Endpoint
from extproc.scheduling.interfaces import SchedulingRequest


class PrefixScorer:
    name = "prefix-cache-scorer"
    approximate_use = "all"  # extproc/scheduling/interfaces.py's Scorer

    def score(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> list[float]:
        total = request.total_blocks
        match = request.prefix_match
        if request.affinity_hash is not None:
            affine = request.affinity_match
            return [(match.get(ep.key, 0) + (ep.key in affine)) / (total + 1) for ep in endpoints]
        if total == 0 or not match:
            return [0.0] * len(endpoints)
        return [match.get(ep.key, 0) / total for ep in endpoints]
