"""precise-prefix-cache-scorer: the share of the prompt's token blocks an endpoint's engine holds.

score(e) = precise_weighted(e) / token_blocks   when e's KV events are usable
         = prefix_match(e) / total_blocks         otherwise (the approximate index, as prefix-cache-scorer)

token_blocks: the prompt's token blocks (`prompt_token_blocks`: its keys, or, where tokenizing
stopped at the first block no endpoint holds, the whole prompt's estimated).

`precise_weighted` (leading token blocks the engine reported storing, plus speculative entries of
requests just routed there, each weighed by the KV cache tier holding it: GPU 1, CPU 0.8,
STORAGE 0.3 by default, extproc/kvevents/tiers.py; so a GPU hit outscores a CPU hit of the same
length, which outscores a miss) and `precise_usable` (endpoints whose event stream is connected,
gap-free and not silent) are filled by the scheduler from extproc/kvevents/manager.py; this
scorer only reads them. A request without token keys (tokenizer unavailable, `cache_salt`) is
scored approximately everywhere, so the approximate index stays in effect wherever no events
arrive. Selected by `--prefix-scorer precise` (it replaces prefix-cache-scorer in the default
profile, with the same weight) or by naming it in an EndpointPickerConfig.

An affinity hint counts as one more leading block on the endpoints in `request.affinity_match`,
as in prefix-cache-scorer: (matched + [e in affinity_match]) / (blocks + 1), with the precise or
the approximate counts as above.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.core.datastore import Endpoint
from extproc.scheduling.interfaces import SchedulingRequest


class PrecisePrefixScorer:
    name = "precise-prefix-cache-scorer"
    approximate_use = "fallback"  # extproc/scheduling/interfaces.py's Scorer

    def score(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> list[float]:
        keys = request.prompt_token_blocks if request.token_keys else 0
        usable = request.precise_usable if keys else frozenset()
        precise, approx = request.precise_weighted, request.prefix_match
        blocks = request.total_blocks
        hinted = request.affinity_hash is not None
        affine = request.affinity_match
        out: list[float] = []
        for ep in endpoints:
            if ep.key in usable:
                matched, total = precise.get(ep.key, 0), keys
            else:
                matched, total = approx.get(ep.key, 0), blocks
            if hinted:
                out.append((matched + (ep.key in affine)) / (total + 1))
            else:
                out.append(matched / total if total else 0.0)
        return out
