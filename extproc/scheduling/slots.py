"""Capacity queues: the wait for a free sequence slot on an endpoint that admits no more.

An engine admits at most a limited number of running sequences (vLLM's max_num_seqs, or fewer
when its KV blocks run out); beyond them requests queue FIFO, however little prefill they
carry. The prefill backlog (extproc/scheduling/latency.py) cannot see that queue, so this
module learns it per endpoint (`SlotState`):

- occupancy T: how long a request holds the endpoint, from the response ends the picker sees:
      sample = (end - routed) - the slot wait predicted for it when it was routed
      T <- sample (the first), then T + ALPHA x (sample - T)
  Unknown until a response has ended there, but bounded below by the requests still holding
  slots (below): the ends seen first are the short ones, and before any end the slots of a busy
  endpoint would otherwise look free.
- admission limit L: running sequences at which the engine stopped admitting. A scrape with
  waiting > 0 and running > 0 is a saturated observation when
    - vllm:num_requests_waiting_by_reason{reason="capacity"} > 0, where exported (the requests
      wait for KV blocks or slots); where exported and 0, the queue is not for capacity (prefill
      budget, adapters) and nothing is learned;
    - else kv usage >= KV_FULL (0.95): the cache admits no more;
    - else running is at the most running seen since the endpoint was first scraped (a ceiling),
      the prefill the picker routed there and predicts not yet done explains at most half of the
      queue (a queue of prompts waiting for prefill is no capacity limit: vLLM admits by token
      budget too), and the queue was seen so CEILING_SCRAPES (2) scrapes in a row.
  L <- running at a saturated observation (the latest: a KV limit moves with the prompts'
  lengths). A scrape showing running > L without a queue proves L no limit: L becomes unknown.
  Unknown until a saturated observation, and for an engine exporting no running/waiting gauges.

Expected wait for a request routed to e, with n requests there already (running, waiting and
routed since the scrape: extproc/scheduling/load.py):

    ahead = n - L + 1                        its place in the queue beyond the L slots
    wait  = ahead x T / L   if ahead > 0     slots free one every T / L on average
          = 0               otherwise (a slot is free)

That average assumes the running requests' ages are spread evenly over T. After a burst they are
not: requests admitted together end together, and the next slot frees much later than T / L.
So where the picker routed every request there itself (its own in-flight ones, `admit` and
`leave`, are all of n) and L <= ORDER_LIMIT, the wait is also read from their ages: the L oldest
hold the slots (FIFO), request i frees its slot in r_i = max(T - age_i, 0), and the request waits
for the ahead-th release, r_(k) + floor((ahead - 1) / L) x T with k = (ahead - 1) mod L + 1 (r sorted).
The larger of the two estimates is charged: a p99 wait is a late one, and the age-based estimate
only corrects the average where it is known to be too low.

The same ages bound T from below (right-censored samples: a request still running has held its
slot at least its age): where at least half of the L slot holders are older than T, T is taken
as the age of the ceil(L/2)-th oldest. In steady state the holders' ages spread over [0, T], so
half of them are younger than T / 2 and the bound does not bind; it binds before any response has
ended (T unknown: a decode-bound engine's slots all taken 3 s into a run, its first ends still to
come, read as free) and after a short first sample (a 1-token probe read T = 15 ms while the
requests of ~3 s held every slot). The median and not the oldest: one long request (a reasoning
trace) among short ones does not make the slots look held for its length.

An endpoint that has not shown its own limit yet takes the pool's (`pool_limit`: the median of
the limits the other endpoints showed, extproc/scheduling/latency.py), as an uncalibrated one
takes the pool's slowdown: replicas of one pool mostly run one configuration, and a replica that
has not queued yet is the one about to, if the picker keeps sending it what its full neighbours
would have taken. Signals an engine does not export, or that were not seen yet anywhere in the
pool, are unknown, never zero: without L or T no wait is charged, and `describe` says which
were missing (--explain-decisions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice

from extproc.core.datastore import ModelServerMetrics

ALPHA = 0.2
KV_FULL = 0.95
CEILING_SCRAPES = 2
ORDER_LIMIT = 64  # admission limits up to which the wait is read from the requests' ages
MAX_ADMITTED = 4096  # own in-flight requests remembered per endpoint (the oldest are dropped)


@dataclass(slots=True)
class SlotState:
    occupancy_ms: float = -1.0  # T; -1: unknown
    limit: float = -1.0  # L; -1: unknown
    limit_source: str = ""  # "capacity-reason", "kv-full" or "ceiling"
    peak_running: float = 0.0  # the most running sequences any scrape showed
    ceiling_seen: int = 0  # consecutive saturated scrapes at the peak
    saturated: bool = False  # the last scrape showed a capacity queue
    admitted: dict[int, float] = field(default_factory=dict)  # own in-flight: token -> routed at (s), oldest first
    # --ablate switches (False: off): charge the wait at all, read it from the holders' ages, infer a ceiling.
    waits: bool = True
    ages: bool = True
    ceiling: bool = True

    @property
    def engine_says_capacity(self) -> bool:
        """The last scrape showed a queue the engine itself says is for capacity (its
        waiting-by-reason gauge) or a full KV cache behind a queue; not the `ceiling` inference,
        which a slow engine's prefill queue can look like."""
        return self.saturated and self.limit_source != "ceiling"

    def admit(self, token: int, at: float) -> None:
        """This picker routed a request here at `at` (clock seconds)."""
        admitted = self.admitted
        if len(admitted) >= MAX_ADMITTED:
            del admitted[next(iter(admitted))]
        admitted[token] = at

    def leave(self, token: int) -> None:
        self.admitted.pop(token, None)

    def observe(self, m: ModelServerMetrics, prefill_queued: float = 0.0) -> None:
        """Learn from one scrape (called once per new scrape); `prefill_queued`: the requests'
        worth of prefill the picker predicts still queued there (backlog / mean uncached tokens)."""
        running, waiting = m.running, m.waiting
        at_peak = running >= self.peak_running
        self.peak_running = max(self.peak_running, running)
        source = ""
        if waiting > 0 and running > 0:
            if m.waiting_capacity >= 0:
                source = "capacity-reason" if m.waiting_capacity > 0 else ""
            elif m.kv_usage >= KV_FULL:
                source = "kv-full"
            elif at_peak and prefill_queued <= waiting / 2 and self.ceiling:
                self.ceiling_seen += 1
                source = "ceiling" if self.ceiling_seen >= CEILING_SCRAPES else ""
            else:
                self.ceiling_seen = 0
        else:
            self.ceiling_seen = 0
        self.saturated = bool(source)
        if source:
            self.limit, self.limit_source = running, source
        elif self.limit > 0 and running > self.limit:
            self.limit, self.limit_source = -1.0, ""

    def finished(self, elapsed_ms: float, charged_wait_ms: float) -> None:
        """A response ended `elapsed_ms` after its routing, having been charged `charged_wait_ms`."""
        sample = max(elapsed_ms - charged_wait_ms, 0.0)
        if self.occupancy_ms < 0:
            self.occupancy_ms = sample
        else:
            self.occupancy_ms += ALPHA * (sample - self.occupancy_ms)

    def wait_ms(self, load: float, now: float | None = None, pool_limit: float = -1.0) -> float:
        """Expected wait for a slot with `load` requests there already; 0 when L is unknown, or T
        is and no ages bound it; with `now`, T and the wait no less than the ages of the picker's
        own requests say; `pool_limit` stands for L until the endpoint shows its own (module
        docstring)."""
        if not self.waits or not self.may_wait(load, pool_limit):
            return 0.0
        limit, t = (self.limit if self.limit > 0 else pool_limit), self.occupancy_ms
        ahead = load - limit + 1
        slots = int(limit)
        holders: list[float] = []
        if now is not None and self.ages and slots <= ORDER_LIMIT and len(self.admitted) >= load:
            holders = [(now - at) * 1000.0 for at in islice(self.admitted.values(), slots)]  # ages, oldest first
            held = holders[(slots + 1) // 2 - 1]  # at least half of the holders held their slot this long
            if held > t:
                t = held
        if t < 0:
            return 0.0
        wait = ahead * t / limit
        if holders:
            remaining = sorted(max(t - age, 0.0) for age in holders)
            k = int(ahead) - 1
            wait = max(wait, remaining[k % slots] + (k // slots) * t)
        return wait

    def may_wait(self, load: float, pool_limit: float = -1.0) -> bool:
        """A slot wait is possible: L is known and a request would have `ahead` > 0. Otherwise
        `wait_ms` is 0 whatever the time (only the ages of the holders move with it)."""
        limit = self.limit if self.limit > 0 else pool_limit
        return limit > 0 and load - limit + 1 > 0

    def describe(self, pool_limit: float = -1.0) -> str:
        if self.limit > 0:
            limit = f"{self.limit:.0f}({self.limit_source})"
        else:
            limit = f"{pool_limit:.0f}(pool)" if pool_limit > 0 else "unknown"
        occupancy = f"{self.occupancy_ms:.0f}ms" if self.occupancy_ms >= 0 else "unknown"
        return f"slots={limit} occupancy={occupancy}"
