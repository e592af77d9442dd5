"""predicted-ttft-scorer: route to the endpoint with the least predicted time to first token.

For each candidate e (extproc/scheduling/latency.py for the model):

1. cached(e): prompt tokens predicted cached on e -- the precise index's matched share of the
   prompt where e's KV events are usable, else the approximate index's matched share of the
   prompt's bytes, in tokens; a match of all max_prefix_blocks looked up counts as the whole
   prompt (what lies beyond is not hashed). A prefix still being computed there counts
   (latency.py). uncached(e) = prompt tokens - cached(e).
   KV cache tiers: the precise match is weighed by the tier holding each block
   (`precise_weighted`, extproc/kvevents/tiers.py), so a block e must bring back from CPU memory
   or storage counts (1 - weight) of a block's prefill as work: 0.2 at the CPU tier's default 0.8.
   One number, not a transfer model: the copy's cost scales with the blocks moved as a prefill
   does, and the weight is the share of a recompute it saves (llm-d's weights, which it also
   reads as load avoided); the engine's own rate calibrates the rest (latency.py).
2. ttft(e): queued prefill work on e plus uncached(e), at e's prefill rate, plus decode contention,
   or, where e's sequence slots are all taken, the expected wait for one plus uncached(e)'s
   prefill, whichever is larger (latency.py, slots.py).
   Prefix affinity needs no weight of its own: a warm replica has less to prefill, and it keeps the
   prefix until its queue costs more than a cold replica's full prefill ("sticky until saturated").
3. Capacity: copying a prefix that another candidate already holds evicts as many tokens of
   other prefixes once e's cache is full. cost(e) = ttft(e) + eviction_weight x fullness(e) x
   (held - cached(e)) x prefill_ms_per_token x slowdown(e). held = the most any candidate has
   cached, or, for every endpoint but the family's home (where the family's requests were last
   placed), the tokens its requests were seen to share, even when the index has forgotten them:
   under pressure the index forgets first, and scattering a family over the pool is what
   fills every cache with the same prefixes. fullness(e) = blocks the prefix index holds for e /
   its capacity (tuned from the engine's num_gpu_blocks), or the engine's
   vllm:kv_cache_usage_perc when higher. eviction_weight is 2 by default: under pressure an
   evicted prefix returns, is recomputed and evicts another in turn. So a prefix is copied once
   the queue on its holders outweighs the prefill AND the recompute it displaces, and spreads
   only onto as many replicas as its load needs. A prompt that no candidate holds (a new prefix,
   or one every cache has forgotten) evicts as much wherever it goes; it is placed by cache room:
   cost(e) += eviction_weight x fullness(e) x prompt tokens x prefill_ms_per_token x slowdown(e)
   x share(e), share(e) being, with LatencyConfig.new_prefix_placement,
   - "homes": homes(e) / mean homes per candidate, homes(e) the other families whose home is e
     (what it evicts is likelier to be live where more families make their home);
   - "churn": churn(e) / mean churn per candidate, churn(e) the tokens e's cache recently
     inserted (latency.py): an LRU cache keeps a block about capacity / insertion rate, so the
     new prefix is likelier to be still there when it is asked again where churn is lower. This
     balances what each cache inserts, as sglang-router's placement by its trees' sizes does.
   A prompt whose larger part no candidate holds (a new conversation after a system prompt the
   replicas hold) is placed by churn for that part, whatever the setting (homes count prefix
   families, and every new conversation joins its system prompt's): cost(e) += eviction_weight x
   fullness(e) x fresh x prefill_ms_per_token x slowdown(e) x churn(e) / mean churn, fresh =
   prompt tokens - the most any candidate holds. Without it, on two real vLLM engines, new
   conversations went to the engine calibrated faster whatever its cache held, until it evicted
   their histories between turns. A prompt mostly held (a question after a shared system prompt,
   a conversation's next turn) pays no such charge: its placement is the queue and the copy it
   would cost.
4. Affinity hints (prompt_cache_key, session header): an endpoint in `request.affinity_match`
   is credited with affinity_credit (0.5) of this request's uncached prefill time there: the key
   says the prompt shares more with that endpoint's earlier requests than the index can see, so
   the endpoint keeps the key until its queue costs more than that share of a prefill.
5. Bounded reuse (extproc/scheduling/reuse.py): where more than `--balance-slack` in-flight
   requests already reuse this request's prefix and e holds more than `--balance-factor` (1.25)
   times the pool's mean load, cached(e) counts 0, so a hot prefix spreads onto as many
   replicas as its load needs instead of piling onto the one that first cached it. A prompt no
   candidate holds goes to an endpoint within its share of that bound, by speed, whenever one is
   (`_bound_new_prompt`).
6. score(e) = min cost / cost(e): 1 for the best, in (0, 1] for the rest; the max-score picker
   then takes the least cost (random among equals). Each candidate's prediction is kept in
   `request.predictions`, and the signals the chosen one's used (and those of any that bounded
   reuse priced out) in `request.signals`, for --explain-decisions.

After the pick (PickObserver), the chosen endpoint's backlog grows by its uncached tokens and the
request keeps what it was charged (`request.routing`); when the response ends, what was queued
there before the request is known done, and the time since the pick is an occupancy sample (and
a calibration sample where the engine exports no TTFT histogram).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Sequence

from extproc.config.settings import NEW_PREFIX_PLACEMENTS, EppConfig
from extproc.core.datastore import Endpoint
from extproc.prefix.capacity import auto_tuned_capacity
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.endpoint_work import EndpointWork
from extproc.scheduling.interfaces import Routing, SchedulingRequest
from extproc.scheduling.latency import LatencyModel
from extproc.scheduling.load import endpoint_load
from extproc.scheduling.queue_ranking import QueueRanking
from extproc.scheduling.reuse import ReuseCounts, load_bound, over_bound, over_load

MAX_HOMES = 65536  # prefix families remembered (~100 bytes each)


class PredictedTtftScorer:
    name = "predicted-ttft-scorer"

    def __init__(self, config: EppConfig, clock: Callable[[], float] = time.monotonic,
                 index: PrefixIndex | None = None) -> None:
        self.config = config.latency
        if self.config.eviction_weight < 0 or self.config.affinity_credit < 0:
            raise ValueError("latency: eviction_weight and affinity_credit must be >= 0")
        if self.config.new_prefix_placement not in NEW_PREFIX_PLACEMENTS:
            raise ValueError(f"latency: new_prefix_placement must be one of {', '.join(NEW_PREFIX_PLACEMENTS)}")
        self._by_churn = self.config.new_prefix_placement == "churn"
        self.block_size_bytes = config.prefix.block_size_bytes
        self.max_prefix_blocks = config.prefix.max_prefix_blocks
        # Benchmark-only switches (--ablate, docs/ablation.md), read once here: each True is the default.
        off = set(config.latency.ablate)
        self.auto_tune = config.prefix.auto_tune and "capacity-auto-tune" not in off
        self._family_memory, self._by_homes = "family-memory" not in off, "homes-placement" not in off
        self._fresh_tail, self._reuse_bound = "fresh-tail-placement" not in off, "bounded-reuse" not in off
        self._new_prompt_bound, self._whole_match = "new-prompt-bound" not in off, "whole-match" not in off
        self._kv_usage = "kv-usage-fullness" not in off
        # The precise index's matches count only with --prefix-scorer precise; --kv-events alone
        # compares the two indexes' predictions without changing the routing.
        self.precise = config.kv_events.prefix_scorer == "precise"
        # extproc/scheduling/interfaces.py's Scorer: precise, it reads the approximate match only
        # for endpoints whose KV events are not usable.
        self.approximate_use = "fallback" if self.precise else "all"
        self.model = LatencyModel(config.latency, config.prefix.bytes_per_token, clock)
        self.ranking = QueueRanking(self.model)
        self.index = index
        self._clock = clock
        # Prefix family (first block) -> (endpoint it was last placed on, tokens its requests shared).
        self._homes: dict[int, tuple[str, float]] = {}
        self._home_counts: dict[str, int] = {}  # endpoint -> families whose home it is
        self.balance = config.balance
        if self.balance.slack < 0 or (self.balance.factor != 0 and self.balance.factor < 1):
            raise ValueError("balance: factor must be 0 (off) or >= 1, and slack >= 0")
        self.reuse = ReuseCounts()

    def bind_index(self, index: PrefixIndex) -> None:
        self.index = index

    def _retune(self, ep: Endpoint) -> None:
        """The prefix index holds what the engine holds: once bytes per token is learned, an
        endpoint's capacity follows it (the scraper tunes it with the configured 4 first)."""
        m = ep.metrics
        if self.index is None or m is None:
            return
        capacity = auto_tuned_capacity(m, self.block_size_bytes, self.model.bytes_per_token)
        if capacity is not None and abs(capacity - self.index.capacity(ep.key)) > 0.05 * capacity:
            with contextlib.suppress(ValueError):
                self.index.set_capacity(ep.key, capacity)

    def _cached(self, request: SchedulingRequest, ep: Endpoint, tokens: float, prompt_bytes: int) -> float:
        keys = request.prompt_token_blocks if request.token_keys else 0
        if self.precise and keys and ep.key in request.precise_usable:
            return tokens * request.precise_weighted.get(ep.key, 0) / keys
        matched = request.prefix_match.get(ep.key, 0)
        if matched >= self.max_prefix_blocks and self._whole_match:
            # Hashing stops at max_prefix_blocks: a prompt that agrees that far (a 30k-token
            # document asked again) is taken as cached beyond, not as 70% cached.
            return tokens
        # The matched share of the prompt's bytes, in tokens (exact or estimated, as `tokens`).
        matched_bytes = matched * self.block_size_bytes
        return tokens * min(matched_bytes / prompt_bytes, 1.0) if prompt_bytes > 0 else 0.0

    def _reuse_key(self, request: SchedulingRequest, ep: Endpoint) -> int | None:
        """The last block the request would reuse on `ep` (reuse.py), None where it reuses none."""
        keys = request.token_keys
        if self.precise and keys and ep.key in request.precise_usable:
            m = request.precise_match.get(ep.key, 0)
            return keys[m - 1] if m else None
        m = min(request.prefix_match.get(ep.key, 0), len(request.block_hashes))
        return request.block_hashes[m - 1] if m else None

    def _bound(self, request: SchedulingRequest, loads: Sequence[float]) -> float | None:
        """reuse.py's load bound for this decision over the pool's loads (the candidates' where
        every candidate is scored); None when the bound is off or there is one candidate."""
        f = self.balance.factor
        pool = request.pool_loads or loads
        if f == 0 or len(pool) < 2:
            return None
        return load_bound(sum(pool), len(pool), f)

    def _prompt_size(self, request: SchedulingRequest) -> tuple[int, float]:
        """(prompt bytes, prompt tokens); without the prompt's size (a caller that only hashed
        it), its blocks stand for it."""
        prompt_bytes = request.prompt_bytes or request.total_blocks * self.block_size_bytes
        return prompt_bytes, self.model.prompt_tokens(request.prompt_tokens, prompt_bytes)

    def _fullness(self, ep: Endpoint) -> float:
        """How full e's cache is: the prefix index's share of its capacity, or the engine's own
        vllm:kv_cache_usage_perc (blocks held by running requests) when that is higher."""
        return self._fullnesses((ep,))[0]

    def _fullnesses(self, endpoints: Sequence[Endpoint]) -> list[float]:
        """`_fullness` of each endpoint, in one loop (read for every candidate)."""
        shares = self.index.used_shares(endpoints) if self.index is not None else [0.0] * len(endpoints)
        out = []
        for ep, used in zip(endpoints, shares, strict=True):
            m = ep.metrics
            if m is not None and m.ok and m.kv_usage > used and self._kv_usage:
                used = m.kv_usage
            out.append(used if used < 1.0 else 1.0)
        return out

    def score(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> list[float]:
        now = self._clock()
        model, c = self.model, self.config
        pool = request.pool or endpoints  # a shortlist scores some (shortlist.py); the state is the pool's
        if len(model) > 2 * len(pool) + 16:
            model.forget_others(pool)
        prompt_bytes, tokens = self._prompt_size(request)
        # Only candidates either index matched can hold any of the prompt (_cached is 0 elsewhere).
        held_somewhere = request.prefix_match.keys() | request.precise_match.keys()
        if self.max_prefix_blocks > 0 and len(held_somewhere) < len(endpoints):
            cached = [self._cached(request, ep, tokens, prompt_bytes) if ep.key in held_somewhere else 0.0
                      for ep in endpoints]
        else:
            cached = [self._cached(request, ep, tokens, prompt_bytes) for ep in endpoints]
        costs: list[float] = []
        predictions = request.predictions
        family = request.block_hashes[0] if request.block_hashes else None
        works = model.works(endpoints, now)
        loads = list(map(endpoint_load, endpoints))
        most = max(cached, default=0.0)
        home_key, shared = self._homes.get(family, ("", 0.0)) if family is not None else ("", 0.0)
        if not self._family_memory:
            shared = 0.0
        # A prompt no candidate holds is placed by cache room (3. above), among the other families;
        # one whose larger part no candidate holds, by churn for that part.
        others = len(self._homes) - (1 if home_key else 0)
        fresh = tokens - most
        by_homes = most <= 0 and not self._by_churn
        mean_homes = others / len(pool) if by_homes and endpoints and self._by_homes else 0.0
        churn_placed = fresh > 0 and most <= fresh and not by_homes and (self._by_churn or self._fresh_tail)
        mean_churn = sum(w.churn for w in works) / len(works) if churn_placed else 0.0
        hits = cached
        # Bounded reuse (5. above): asked only where something is cached and some prefix is counted;
        # a prompt nobody holds is bounded by load alone, below.
        bound = self._bound(request, loads) if most > 0 and len(self.reuse) and self._reuse_bound else None
        if bound is not None:
            slack = self.balance.slack
            hits = list(cached)
            for i, hit in enumerate(cached):
                if hit > 0:
                    ep = endpoints[i]
                    key = self._reuse_key(request, ep)
                    if key is not None and over_bound(self.reuse.get(ep.key, key), loads[i], bound, slack):
                        hits[i] = 0.0  # priced as a cold replica
                        # Its signals say so (described here: the others' only for the chosen one, at the pick).
                        _, _, wait = model.predict(ep, works[i], tokens)
                        request.signals[ep.key] = model.describe(ep, works[i], wait) + " reuse=over-bound"
        held_away = max(most, min(shared, tokens))
        uncached_all = [tokens - hit for hit in hits]
        ttfts = model.predict_ttfts(endpoints, works, uncached_all, loads)
        fullness = self._fullnesses(endpoints) if c.eviction_weight else ttfts
        for ep, w, hit, uncached, ttft, full in zip(endpoints, works, hits, uncached_all, ttfts, fullness,
                                                    strict=True):
            cost = ttft
            held = most if ep.key == home_key else held_away
            if c.eviction_weight and (hit < held or mean_homes > 0 or mean_churn > 0):
                # The recompute a full cache displaces, per token placed there.
                evict_ms = c.eviction_weight * full * c.prefill_ms_per_token * w.slowdown
                displaced = held - hit
                if displaced > 0.0:  # max(0.0, held - hit), without the call per candidate
                    cost += evict_ms * displaced
                if mean_churn > 0:
                    cost += evict_ms * fresh * w.churn / mean_churn
                elif mean_homes > 0:
                    cost += evict_ms * tokens * self._other_homes(ep.key, home_key) / mean_homes
            if ep.key in request.affinity_match:
                cost -= c.affinity_credit * uncached * c.prefill_ms_per_token * w.slowdown
            predictions[ep.key] = (ttft, uncached)
            # A credit never makes a cost vanish or turn negative: floored at the endpoint's own
            # fixed cost, in its calibrated scale (an engine measured 10x faster than the prior
            # predicts below the prior's overhead, and one floor for all would tie them).
            floor = c.overhead_ms * w.slowdown
            if floor < 1e-3:
                floor = 1e-3
            costs.append(floor if cost < floor else cost)  # max(cost, floor): a NaN stays NaN, as there
        if most <= 0 and self._new_prompt_bound:
            self._bound_new_prompt(request, loads, works, costs)
        best = min(costs, default=1e-3)
        return [best / cost for cost in costs]

    def queue_costs(self, endpoints: Sequence[Endpoint], keys: Sequence[str]) -> tuple[list[float], list[float]]:
        """QueueRanker: each endpoint's load and its predicted TTFT for a prompt it holds whole (0 uncached
        tokens: its fixed cost, queued prefill and decode contention at its slowdown, or its slot
        wait); the shortlist (extproc/scheduling/shortlist.py) keeps the endpoints where it is
        least. Kept between decisions and recomputed where something changed
        (extproc/scheduling/queue_ranking.py); every endpoint's new scrape is applied on the way,
        scored or not: the model learns from each scrape as it lands (the idle bound counts the
        tokens routed since the scrape before; slot limits and late first tokens are read from
        each), so one left unread until the endpoint is next scored is a staler model. A ranking
        from the states as they were (no scrape applied) had a worse TTFT tail through Envoy at
        64 simulated replicas than scoring every one; this one was level."""
        return self.ranking.rank(endpoints, keys, self._clock())

    def least_waiting(self, k: int, rng: random.Random) -> list[int]:
        """QueueRanker: the k least-waiting of the last `queue_costs` (queue_ranking.py keeps them sorted)."""
        return self.ranking.least(k, rng)

    def _bound_new_prompt(self, request: SchedulingRequest, loads: Sequence[float],
                          works: Sequence[EndpointWork], costs: list[float]) -> None:
        """A prompt no candidate holds has no cache to keep: it goes to an endpoint within its load
        bound whenever one is, whatever the others' costs. Otherwise, on an idle pool, the endpoint
        whose calibrated slowdown is a little lower takes every new prompt. Each endpoint's bound
        is its share of reuse.py's by speed (1 / slowdown), as bounded loads with weights:

            bound(e) = ceil(factor x (L + 1) x speed(e) / sum of speeds)

        equal to reuse.py's ceil(factor x (L + 1) / n) where the speeds are equal. A replica
        measured 4x slower than the rest holds about a quarter of a fast one's share, so it is
        not handed a new prompt (a full prefill at 4x) because the fast ones hold their share.
        L is the pool's load; where a shortlist is scored, the pool's speeds are taken as the
        shortlist's mean speed times the pool's size."""
        if self._bound(request, loads) is None:
            return
        pool = request.pool_loads or loads
        speeds = [1.0 / w.slowdown if w.slowdown > 0 else 1.0 for w in works]
        total_load, total_speed, f = sum(pool), sum(speeds) * len(pool) / len(loads), self.balance.factor
        over = [over_load(load, load_bound(total_load, total_speed, f, speed))
                for load, speed in zip(loads, speeds, strict=True)]
        within = [cost for cost, o in zip(costs, over, strict=True) if not o]
        if within and len(within) < len(costs):
            worst = max(within)
            for i, o in enumerate(over):
                if o:
                    costs[i] += worst

    # -- PickObserver ----------------------------------------------------------------------------
    def picked(self, request: SchedulingRequest, chosen: Endpoint) -> None:
        predicted = request.predictions.get(chosen.key)
        if predicted is None:
            return
        now = self._clock()
        _, uncached = predicted
        w = self.model.work(chosen, now)
        family = request.block_hashes[0] if request.block_hashes else None
        _, tokens = self._prompt_size(request)
        _, base, wait = self.model.predict(chosen, w, uncached)
        if chosen.key not in request.signals:  # described once, for the endpoint reported, not per candidate
            request.signals[chosen.key] = self.model.describe(chosen, w, wait)
        request.routing = Routing(chosen.key, now, base, wait,
                                  self.model.decode_ms(chosen, request.max_output_tokens),
                                  self.model.admit(chosen, now, base, wait, uncached))
        self.model.routed(chosen, uncached, base, now, request.prompt_bytes, estimated=request.prompt_tokens <= 0)
        if self.auto_tune:
            self._retune(chosen)
        request.backlog_mark = (chosen.key, self.model.mark(chosen))
        self._count_reuse(request, chosen)
        if family is not None:
            homes = self._homes
            before, shared = homes.pop(family, ("", 0.0))
            if before:
                self._unhome(before)
            homes[family] = (chosen.key, max(shared, tokens - uncached))  # re-inserted last: LRU order
            counts = self._home_counts
            counts[chosen.key] = counts.get(chosen.key, 0) + 1
            if len(homes) > MAX_HOMES:
                self._unhome(homes.pop(next(iter(homes)))[0])

    def _count_reuse(self, request: SchedulingRequest, ep: Endpoint) -> None:
        key = self._reuse_key(request, ep) if self.balance.factor else None
        if key is not None and self.reuse.acquire(ep.key, key):
            request.reuse = (ep.key, key)

    def _release_reuse(self, request: SchedulingRequest) -> None:
        if request.reuse is not None:
            self.reuse.release(*request.reuse)
            request.reuse = None

    def _other_homes(self, key: str, home_key: str) -> int:
        return self._home_counts.get(key, 0) - (1 if key == home_key else 0)

    def _unhome(self, key: str) -> None:
        left = self._home_counts[key] - 1
        if left:
            self._home_counts[key] = left
        else:
            del self._home_counts[key]

    def finished(self, request: SchedulingRequest, endpoint: Endpoint, ok: bool = True) -> None:
        mark = request.backlog_mark
        now = self._clock()
        if mark is not None and mark[0] == endpoint.key:
            self.model.finished(endpoint, mark[1], now)
        routing = request.routing
        if routing is not None and routing.endpoint == endpoint.key:
            if ok:
                self.model.response_ended(endpoint, routing, now)
            else:  # a fast error is no evidence of a fast engine: leave its slot, learn nothing
                self.model.leave(endpoint, routing.token)
        if request.reuse is not None and request.reuse[0] == endpoint.key:
            self._release_reuse(request)

    def moved(self, request: SchedulingRequest, primary: Endpoint, served: Endpoint) -> None:
        now = self._clock()
        before = request.predictions.get(primary.key)
        after = request.predictions.get(served.key)
        if before is not None:
            self.model.unrouted(primary, before[1], now)
        if after is not None:
            self.model.routed(served, after[1], None, now, estimated=request.prompt_tokens <= 0)
            request.backlog_mark = (served.key, self.model.mark(served))
        if request.routing is not None:
            self.model.leave(primary, request.routing.token)
        request.routing = None  # not this picker's prediction any more: neither occupancy nor calibration
        self._release_reuse(request)
        self._count_reuse(request, served)
