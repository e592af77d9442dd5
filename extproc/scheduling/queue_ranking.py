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

So the ranking keeps each endpoint's load and cost with the in-flight count and metrics they
were computed from, recomputes only the endpoints where 1-3 happened, and recomputes all of them
when 4 happened, when the pool is not the one it ranked last, or once its costs are `refresh_s`
old (RANK_REFRESH_S: 20 ms): time's effect on the order is bounded by 20 ms of drain. At a few
decisions a second every decision recomputes everything, as before; at hundreds a second the
full pass is paid once per 20 ms. A new scrape is still applied to the model before its
endpoint is ranked (1), so the model learns from every scrape as it lands, scored or not (a
ranking without that had a worse TTFT tail through Envoy: shortlist.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from extproc.core.datastore import Endpoint, ModelServerMetrics
from extproc.scheduling.latency import LatencyModel
from extproc.scheduling.load import endpoint_load

RANK_REFRESH_S = 0.02


class QueueRanking:
    def __init__(self, model: LatencyModel, refresh_s: float = RANK_REFRESH_S) -> None:
        self.model = model
        self.refresh_s = refresh_s
        self._keys: list[str] = []
        self._loads: list[float] = []
        self._costs: list[float] = []
        self._inflight: list[int] = []
        self._metrics: list[ModelServerMetrics | None] = []
        self._at = -math.inf
        self._version = -1
        self.full_passes = 0  # for tests and profiles: how often every endpoint was recomputed

    def rank(self, endpoints: Sequence[Endpoint], keys: Sequence[str], now: float) -> tuple[list[float], list[float]]:
        """(each endpoint's load, its predicted TTFT for 0 uncached tokens), in the order given;
        both read only, and updated in place by the next call. A load changes only with the
        endpoint's in-flight count or a new scrape (load.py), so it is kept and recomputed with
        the cost."""
        model = self.model
        inflight = [ep.inflight for ep in endpoints]
        metrics = [ep.metrics for ep in endpoints]
        if now - self._at >= self.refresh_s or model.pool_version != self._version or keys != self._keys:
            self._version = model.pool_version  # read first: a move during the pass shows next time
            loads = list(map(endpoint_load, endpoints))
            self._costs = model.predict_ttfts(endpoints, model.works(endpoints, now), [0.0] * len(endpoints), loads)
            self._keys, self._loads, self._inflight, self._metrics, self._at = list(keys), loads, inflight, metrics, now
            model.touched.clear()
            self.full_passes += 1
            return loads, self._costs
        loads, costs, seen_inflight, seen_metrics = self._loads, self._costs, self._inflight, self._metrics
        changed = [i for i, (n, m, had_n, had_m)
                   in enumerate(zip(inflight, metrics, seen_inflight, seen_metrics, strict=True))
                   if n != had_n or m is not had_m]
        touched = model.touched
        if touched:
            at = set(changed)
            changed.extend(i for i in map(keys.index, touched.intersection(keys)) if i not in at)
            touched.clear()
        if changed:
            eps = [endpoints[i] for i in changed]
            fresh_loads = list(map(endpoint_load, eps))
            fresh = model.predict_ttfts(eps, model.works(eps, now), [0.0] * len(eps), fresh_loads)
            for i, load, cost in zip(changed, fresh_loads, fresh, strict=True):
                loads[i], costs[i] = load, cost
                seen_inflight[i], seen_metrics[i] = inflight[i], metrics[i]
        return loads, costs
