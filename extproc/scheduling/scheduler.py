"""The scheduler: one pass of filters -> prefix lookup -> weighted scorers -> picker -> record.

1. Filters run in order; an empty result fails the request (the caller maps it to an error).
2. When the request has token keys, the precise index is consulted for the surviving candidates
   (`request.precise_match`, `precise_usable`); then the approximate prefix index, once
   (`request.prefix_match`): for every candidate, or, where every scorer reads it only as the
   fallback for endpoints without usable KV events (precise routing), for those alone; the
   chosen endpoint's approximate match is then read on its own after the pick (the decision's
   `matched_blocks`: the hit-ratio metric, the closed loop). At 256 endpoints the approximate
   lookup walked dicts of millions of entries for nothing the scorers used.
   An affinity hint is looked up in the same index as a one-block chain of its own:
   `request.affinity_match` = candidates holding `affinity_hash`.
   Above --max-scored-endpoints candidates, only a shortlist of them is scored: those holding
   part of the prompt, the least waiting and a random sample (extproc/scheduling/shortlist.py).
3. total(e) = sum_i weight_i * clamp(score_i(e), 0, 1) (the Go EPP's unnormalised weighted sum).
4. The picker returns up to `max_endpoints` endpoints, best first.
5. The request's block hashes are recorded in the index for the first pick, so later requests
   with the same prefix find it there; its token keys become speculative entries of the precise
   index. Both records are made after the answer: queued at decision time (`record_later`) and
   made on the event loop's next turn, once the caller has handed the decision to the transport,
   or by the next read of that index, whichever comes first (the next decision's lookup
   included: it never misses a record). At a pool of 256 endpoints the approximate record's
   inserts and evictions were most of an 8k-token decision (docs/scale.md). Stateful scorers
   (`PickObserver`: predicted-ttft-scorer's backlogs) are told the pick. The affinity hash is
   recorded apart, as its own one-block chain (not in front of the prompt's blocks: requests
   with other keys but the same prompt still match them), so it obeys the index's LRU bounds and
   peer sync spreads it like any record. When the proxy reports that a fallback served the
   request instead (`reassign`), the approximate records (blocks and affinity hash) and the
   observers' state move there (speculative precise entries expire).

With prefill/decode disaggregation (`prefill`, extproc/scheduling/disagg.py) this scheduler is the
decode profile's; after its pick the decider and the prefill profile's scheduler run, and the
prefill pick becomes the decision's `prefill`, ended with it in `finished`.

`Decision` keeps each scorer's score of the chosen endpoint, the matched blocks and, with
predicted-ttft-scorer, every candidate's predicted TTFT and the signals the chosen endpoint's
prediction used (its slot limit and occupancy or "unknown", the slot wait charged, whether its
queue was scraped, where its slowdown comes from), which the optional explanation header reports.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from extproc.core.datastore import Endpoint
from extproc.core.errors import EppError, ErrorCode
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.interfaces import (
    Deferred,
    Filter,
    Picker,
    PickObserver,
    PreciseSource,
    QueueRanker,
    SchedulingRequest,
    Scorer,
)
from extproc.scheduling.shortlist import Shortlist

if TYPE_CHECKING:
    from extproc.scheduling.disagg import PrefillStage


@dataclass(slots=True)
class Decision:
    endpoints: list[Endpoint]
    matched_blocks: int
    total_blocks: int
    scores: list[tuple[str, float]]  # (scorer name, score of the chosen endpoint)
    total: float
    precise_matched: int | None = None  # blocks the precise index matched on the chosen endpoint
    precise_weighted: float = 0.0  # those blocks weighed by the KV cache tier holding them
    precise_total: int = 0
    precise_usable: bool = False  # the chosen endpoint's KV events were usable
    block_hashes: Sequence[int] = ()  # recorded in the index for the primary endpoint
    affinity_hash: int | None = None  # recorded in the index for the primary endpoint
    affinity_hit: bool | None = None  # None: no hint; else the primary was in affinity_match
    request: SchedulingRequest | None = None  # for the observers when a fallback serves it
    # Prefill/decode disaggregation (extproc/scheduling/disagg.py), set on the decode decision: the
    # prefill pick (None: decode-only), the decider's outcome ("" without a P/D profile handler) and
    # the prompt's tokens it estimated not cached on the decode endpoint.
    prefill: Decision | None = None
    pd: str = ""
    uncached_tokens: int = 0

    @property
    def predicted_ms(self) -> float | None:
        """predicted-ttft-scorer's prediction for the primary endpoint, if it ran."""
        if self.request is None:
            return None
        p = self.request.predictions.get(self.primary.key)
        return p[0] if p is not None else None

    @property
    def primary(self) -> Endpoint:
        return self.endpoints[0]

    @property
    def destination(self) -> str:
        return ",".join(ep.key for ep in self.endpoints)

    @property
    def prefiller(self) -> str | None:
        """The prefill endpoint's ip:port (x-prefiller-host-port) when disaggregated, else None."""
        return self.prefill.primary.key if self.prefill is not None else None

    def explain(self) -> str:
        parts = [f"endpoint={self.primary.key}", f"matched={self.matched_blocks}/{self.total_blocks}"]
        if self.precise_matched is not None:
            usable = "" if self.precise_usable else " (approximate fallback)"
            weighed = "" if self.precise_weighted == self.precise_matched else \
                f" (tier-weighted {self.precise_weighted:g})"
            parts.append(f"precise={self.precise_matched}/{self.precise_total}{weighed}{usable}")
        if self.affinity_hit is not None:
            parts.append("affinity=hit" if self.affinity_hit else "affinity=miss")
        parts.extend(f"{name}={score:.3f}" for name, score in self.scores)
        parts.append(f"total={self.total:.3f}")
        if self.pd:
            parts.append(f"pd={self.pd}")
            parts.append(f"uncached_tokens={self.uncached_tokens}")
        if self.prefill is not None:
            p = self.prefill
            scores = ",".join(f"{name}:{score:.3f}" for name, score in p.scores)
            parts.append(f"prefill={p.primary.key} (matched={p.matched_blocks}/{p.total_blocks}; {scores})")
        if self.request is not None and self.request.predictions:
            ranked = sorted(self.request.predictions.items(), key=lambda kv: kv[1][0])
            parts.append("predicted_ttft_ms=" + ",".join(f"{k}:{p[0]:.1f}" for k, p in ranked))
            used = self.request.signals.get(self.primary.key)
            if used:
                parts.append(f"signals={used}")
        return "; ".join(parts)


@dataclass(slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


class Scheduler:
    def __init__(
        self,
        filters: Sequence[Filter],
        scorers: Sequence[WeightedScorer],
        picker: Picker,
        index: PrefixIndex | None,
        max_endpoints: int,
        precise: PreciseSource | None = None,
        shortlist: Shortlist | None = None,
        pin: bool = True,
    ) -> None:
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.picker = picker
        self.index = index
        self.max_endpoints = max_endpoints
        self.precise = precise
        self.shortlist = shortlist
        self.pin = pin  # False (--ablate pins): a running request's blocks stay in the LRU order
        self.observers = [ws.scorer for ws in self.scorers if isinstance(ws.scorer, PickObserver)]
        # Some scorer reads the approximate match of endpoints whose KV events are usable.
        self.approximate_for_usable = any(getattr(ws.scorer, "approximate_use", "all") == "all"
                                          for ws in self.scorers)
        self.ranker = next((ws.scorer for ws in self.scorers if isinstance(ws.scorer, QueueRanker)), None)
        # P/D disaggregation: the decider and the prefill profile run after this (decode) pick.
        self.prefill: PrefillStage | None = None

    def schedule(self, request: SchedulingRequest, candidates: Sequence[Endpoint]) -> Decision:
        endpoints: Sequence[Endpoint] = candidates
        for f in self.filters:
            endpoints = f.filter(request, endpoints)
            if not endpoints:
                raise EppError(ErrorCode.SERVICE_UNAVAILABLE, f"no endpoint left after filter {f.name}")
        keys = [ep.key for ep in endpoints]
        index = self.index
        token_keys = request.token_keys or []
        precise = self.precise if token_keys else None
        if precise is not None:
            request.precise_match, request.precise_usable, request.precise_weighted = precise.match(token_keys, keys)
        # Where the scorers read the approximate match only as the fallback, endpoints with usable
        # KV events are not asked (the chosen one's match is read after the pick, for the decision).
        approximate_asked = keys
        if precise is not None and not self.approximate_for_usable and request.precise_usable:
            usable = request.precise_usable
            approximate_asked = [k for k in keys if k not in usable]
        if index is not None and request.block_hashes and approximate_asked:
            request.prefix_match = index.match(request.block_hashes, approximate_asked)
        affinity = request.affinity_hash if index is not None else None
        if affinity is not None and index is not None:
            request.affinity_match = frozenset(index.match((affinity,), keys))
        if self.shortlist is not None and self.shortlist.applies(len(endpoints)):
            endpoints = self.shortlist.select(request, endpoints, keys, self.ranker)
        totals: list[float] = [0.0] * len(endpoints)
        per_scorer: list[list[float]] = []
        for k, ws in enumerate(self.scorers):
            scores = ws.scorer.score(request, endpoints)
            # min(max(s, 0.0), 1.0) (NaN stays NaN) without two calls per endpoint.
            clamped = [0.0 if s < 0.0 else 1.0 if s > 1.0 else s for s in scores]
            per_scorer.append(clamped)
            w = ws.weight
            if k == 0:  # 0 + w x, one pass fewer (none for the default's single scorer of weight 1)
                totals = clamped if w == 1.0 else [w * x for x in clamped]
            else:
                totals = [t + w * x for t, x in zip(totals, clamped, strict=True)]
        picked = self.picker.pick(endpoints, totals, self.max_endpoints)
        chosen = picked[0]
        ci = endpoints.index(chosen)
        matched = request.prefix_match.get(chosen.key, 0)
        if index is not None and request.block_hashes and approximate_asked is not keys \
                and chosen.key in request.precise_usable:
            matched = index.leading(chosen.key, request.block_hashes)  # before its record below
        if index is not None:
            # Pinned while the request runs (extproc/prefix/generations.py); record_later ignores no blocks.
            if index.record_later(chosen.key, request.block_hashes, pin=self.pin):
                _flush_after_answer(index)
            if affinity is not None:
                _record_after_answer(index, chosen.key, (affinity,))
        if precise is not None:
            precise.chosen(chosen.key)
            _record_after_answer(precise, chosen.key, token_keys)
        for observer in self.observers:
            observer.picked(request, chosen)
        decision = Decision(
            endpoints=picked,
            matched_blocks=matched,
            total_blocks=request.total_blocks,
            scores=[(ws.scorer.name, per_scorer[k][ci]) for k, ws in enumerate(self.scorers)],
            total=totals[ci],
            precise_matched=request.precise_match.get(chosen.key, 0) if precise is not None else None,
            precise_weighted=request.precise_weighted.get(chosen.key, 0) if precise is not None else 0.0,
            precise_total=request.prompt_token_blocks,
            precise_usable=chosen.key in request.precise_usable,
            block_hashes=request.block_hashes if index is not None else (),
            affinity_hash=affinity,
            affinity_hit=None if affinity is None else chosen.key in request.affinity_match,
            request=request if self.observers else None,
        )
        if self.prefill is not None:
            self.prefill.after(request, candidates, decision, self)
        return decision

    def finished(self, decision: Decision, endpoint: Endpoint, ok: bool = True) -> None:
        """The response from `endpoint` ended (or the stream did): its blocks are no longer pinned
        there, and are the most recently used (extproc/prefix/generations.py); tell the observers.
        A failed response (`ok` False: a 5xx, a reset) taught nothing: the blocks it recorded
        beyond the prefix the endpoint already held are forgotten there, and the observers
        release what they held without learning from it."""
        index = self.index
        if index is not None and decision.block_hashes:
            index.release(endpoint.key, decision.block_hashes)
            if not ok:
                held = decision.matched_blocks if endpoint is decision.primary else 0
                index.forget(endpoint.key, decision.block_hashes[held:])
        if decision.request is not None:
            for observer in self.observers:
                observer.finished(decision.request, endpoint, ok)
        if decision.prefill is not None and self.prefill is not None:
            self.prefill.scheduler.finished(decision.prefill, decision.prefill.primary, ok)

    def reassign(self, decision: Decision, served: Endpoint) -> None:
        """Another endpoint of the decision's list served the request (a fallback after the
        first choice failed): move the index records from the primary to it. Only what the
        primary did not already hold (blocks beyond its matched prefix, an affinity hash it had
        not recorded before) is forgotten there."""
        if decision.request is not None:
            for observer in self.observers:
                observer.moved(decision.request, decision.primary, served)
        index = self.index
        if index is None:
            return
        if decision.block_hashes:
            index.release(decision.primary.key, decision.block_hashes)
            index.forget(decision.primary.key, decision.block_hashes[decision.matched_blocks:])
            index.record(served.key, decision.block_hashes, pin=self.pin)
        if decision.affinity_hash is not None:
            if not decision.affinity_hit:
                index.forget(decision.primary.key, (decision.affinity_hash,))
            index.record(served.key, (decision.affinity_hash,))


def _record_after_answer(index: Deferred, endpoint: str, hashes: Sequence[int]) -> None:
    """Queue the record and arrange one flush on the running loop's next turn (at once without a loop)."""
    if index.record_later(endpoint, hashes):
        _flush_after_answer(index)


def _flush_after_answer(index: Deferred) -> None:
    """One flush of the records queued, on the running loop's next turn (at once without a loop)."""
    try:
        asyncio.get_running_loop().call_soon(index.flush)
    except RuntimeError:
        index.flush()
