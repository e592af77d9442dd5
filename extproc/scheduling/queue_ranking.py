"""The least-waiting ranking of a large pool, kept between decisions (shortlist.py's part 2).

Ranking every endpoint by its predicted queue (predicted-ttft-scorer's prediction for a prompt it
holds whole) means bringing each endpoint's latency state up to date and predicting it, about
0.6 us an endpoint: at 256 endpoints most of what a shortlisted decision still paid for the pool's
size (docs/scale.md). Between two decisions little of it changes. An endpoint's queue moves when

1. a scrape of it lands (its metrics object is a new one),
2. its in-flight count changes (a request routed there or answered), which with the scrape is
   all its load reads (extproc/scheduling/load.py),
3. the model changed its state through a single-endpoint call (a request routed, answered, moved
   away: `LatencyModel.touched`),
4. a pool-wide quantity moved (the pool's admission limit or slowdown, bytes per token:
   `LatencyModel.pool_version`),
5. or time passed: a backlog drains at one ms of predicted TTFT per ms wherever there is one (the
   same for every busy endpoint, so their order holds), and a slot wait shortens as the requests
   holding the slots age.

So the ranking keeps each endpoint's load and cost, recomputes only the endpoints where 1-3
happened, and recomputes all of them when 4 happened (at once where a scrape it applied moved the
pool's quantity, so that no answer mixes two pool limits) or when the pool is not the one it
ranked last. 1 and 2 come from the datastore's change log (extproc/core/changes.py: the keys it changed
since the position the ranking read last), 3 from the model's `touched`, so a decision's work is
the number of changes, not the pool's size; a log that dropped keys the ranking had not read yet
costs a full pass. For 5, the ranking keeps the positions whose last prediction moves with time
(`LatencyModel.moves_with_time`: a backlog, or a request that would wait for a slot) and
recomputes them once its costs are `refresh_s` old (RANK_REFRESH_S: 20 ms), so time's effect on
the order is bounded by 20 ms of drain; every other endpoint's prediction stays what it was until
1-4 happens to it, exactly what a full pass would compute (tests/scheduling/test_queue_ranking.py
walks time, routings, ends and scrapes and compares at every refresh). A low request rate
therefore no longer pays a pass over an idle pool at each decision (it did: at 256 endpoints a
full pass cost as much as the rest of a decision's ranking). A new scrape is still applied to
the model before its endpoint is ranked (1), so the model learns from every scrape as it lands,
scored or not (a ranking without that had a worse TTFT tail through Envoy: shortlist.py).

The shortlist asks for the `least(k)` of them: the ranking keeps the positions sorted by cost,
moving only the recomputed ones (a bisection each; past an eighth of the pool, sorting the
order again instead) and, at a full pass, sorting the last order again (mostly sorted still),
so the least k are the first k; the endpoints tied at the k-th cost
(an idle pool's are all tied) are drawn at random, so that equal ones do not favour the pool's
first endpoints. Its key map and its check that the endpoints share one log are redone only when
the pool changes.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence

from extproc.core.changes import Changes
from extproc.core.datastore import Endpoint
from extproc.scheduling.draws import draw_into
from extproc.scheduling.latency import LatencyModel
from extproc.scheduling.load import endpoint_load

RANK_REFRESH_S = 0.02
# Where more than 1 / RESORT_SHARE of the pool was recomputed, the order is sorted again rather
# than moved one position at a time (each move scans the order).
RESORT_SHARE = 8


class QueueRanking:
    def __init__(self, model: LatencyModel, refresh_s: float = RANK_REFRESH_S) -> None:
        self.model = model
        self.refresh_s = refresh_s
        self._keys: list[str] = []
        self._where: dict[str, int] = {}  # key -> position in _keys
        self._loads: list[float] = []
        self._costs: list[float] = []
        self._order: list[int] = []  # positions by ascending cost (ties in no particular order)
        self._timed: set[int] = set()  # positions whose last prediction moves with time
        self._changes: Changes | None = None  # the ranked endpoints' change log (all share it), or None
        self._position = 0  # in _changes, read up to here
        self._at = -math.inf  # the last time-driven refresh
        self._version = -1
        self.full_passes = 0  # for tests and profiles: how often every endpoint was recomputed

    def rank(self, endpoints: Sequence[Endpoint], keys: Sequence[str], now: float) -> tuple[list[float], list[float]]:
        """(each endpoint's load, its predicted TTFT for 0 uncached tokens), in the order given;
        both read only, and updated in place by the next call. A load changes only with the
        endpoint's in-flight count or a new scrape (load.py), so it is kept and recomputed with
        the cost."""
        model, log = self.model, self._changes
        new = log.since(self._position) if log is not None else None
        if log is None or new is None or model.pool_version != self._version or keys != self._keys:
            return self._full(endpoints, keys, now)
        self._position = log.position
        where = self._where
        changed: set[int | None] = set(map(where.get, new))
        touched = model.touched
        if touched:
            changed.update(map(where.get, touched))
            touched.clear()
        if now - self._at >= self.refresh_s:
            changed |= self._timed
            self._at = now
        at = sorted(i for i in changed if i is not None)  # None: a key of another pool
        if at:
            self._recompute(endpoints, at, now)
            if model.pool_version != self._version:  # a scrape it applied moved a pool-wide quantity
                return self._full(endpoints, keys, now)
        return self._loads, self._costs

    def _recompute(self, endpoints: Sequence[Endpoint], at: list[int], now: float) -> None:
        model = self.model
        eps = [endpoints[i] for i in at]
        fresh_loads = list(map(endpoint_load, eps))
        works = model.works(eps, now)
        fresh = model.predict_ttfts(eps, works, [0.0] * len(eps), fresh_loads)
        loads, costs, order, timed, moves = self._loads, self._costs, self._order, self._timed, model.moves_with_time
        for i, w, load, cost in zip(at, works, fresh_loads, fresh, strict=True):
            loads[i], costs[i] = load, cost
            if moves(w, load):
                timed.add(i)
            else:
                timed.discard(i)
        if len(at) * RESORT_SHARE > len(order):
            order.sort(key=costs.__getitem__)
        else:
            for i in at:
                order.remove(i)  # a scan in C; a bisection by the old cost would trip on a NaN
                insort(order, i, key=costs.__getitem__)

    def _full(self, endpoints: Sequence[Endpoint], keys: Sequence[str], now: float) -> tuple[list[float], list[float]]:
        model = self.model
        log = endpoints[0].changes if endpoints else None
        if keys != self._keys or log is not self._changes:  # another pool, or its first pass
            self._keys = list(keys)
            self._where = {k: i for i, k in enumerate(self._keys)}
            self._order = list(range(len(endpoints)))
            # One datastore's endpoints share its log; any other list is recomputed at every call.
            if log is not None and not all(ep.changes is log for ep in endpoints):
                log = None
        self._changes = log
        self._position = log.position if log is not None else 0  # read first: a change during the pass shows next time
        loads = list(map(endpoint_load, endpoints))
        works = model.works(endpoints, now)
        self._version = model.pool_version  # after the scrapes `works` applied: the costs below read it
        costs = self._costs = model.predict_ttfts(endpoints, works, [0.0] * len(endpoints), loads)
        self._order.sort(key=costs.__getitem__)  # the last order, mostly still sorted: little to move
        moves = model.moves_with_time
        self._timed = {i for i, (w, load) in enumerate(zip(works, loads, strict=True)) if moves(w, load)}
        self._loads, self._at = loads, now
        model.touched.clear()
        self.full_passes += 1
        return loads, costs

    def least(self, k: int, rng: random.Random) -> list[int]:
        """Positions of the k least-waiting endpoints of the last `rank`; of those tied at the
        k-th cost, as many as fit, drawn at random."""
        order, cost = self._order, self._costs.__getitem__
        if k >= len(order):
            return list(order)
        if k <= 0:
            return []
        edge = cost(order[k - 1])
        hi = bisect_right(order, edge, key=cost)
        if hi == k:
            return order[:k]
        lo = bisect_left(order, edge, key=cost)
        tied: set[int] = set()
        draw_into(tied, hi - lo, k - lo, rng)
        return order[:lo] + [order[lo + t] for t in tied]
