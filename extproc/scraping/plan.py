"""When each endpoint's /metrics is scraped: a paced, earliest-due-first plan with a pool-wide budget.

One scrape costs the picker ~0.35 ms of CPU (HTTP client, reading, parsing; ~0.55 ms for vLLM's
whole ~125 KB page, which extproc/scraping/scraper.py no longer asks for; bench/results/scale.md)
and costs the engine a render of its exposition, so a fixed interval per endpoint makes the cost
grow with the pool: 256 endpoints every 50 ms are 5,120 scrapes a second. Here the pool shares one
budget:

    interval(n) = max(base, n / budget)        seconds between two scrapes of one endpoint
    spacing(n)  = interval(n) / n              seconds between two scrape starts, pool-wide

with `base` = --refresh-metrics-interval (50 ms) and `budget` = --scrape-budget (scrapes per
second for the whole pool; 0: unbounded, every endpoint at `base`). So the pool is scraped at
min(n / base, budget) per second: up to base * budget endpoints (25 at the defaults) nothing
changes; beyond, each endpoint's interval grows with n and the total stays at the budget.

Order: earliest due first. An endpoint is due `interval(n)` after its last scrape started (at
once when added); consecutive starts are at least `spacing(n)` apart, so scrapes spread evenly
over the interval instead of arriving in bursts (256 endpoints added at once are first scraped
over one interval, not in one tick). An endpoint the picker routes a request to (`touch`) falls
due `base` after its last scrape started instead: the endpoints whose state the picker is
changing are refreshed first; within the same budget, others wait a little longer.

Freshness at decision time: a scrape is on average interval(n)/2 old (at most interval(n) plus
the scrape's own latency); at 256 endpoints and the default budget (500/s) that is 256 ms on
average, 512 ms at most, and about `base` (50 ms) for an endpoint that keeps being routed to,
as long as those are fewer than budget * base (25). The
picker's own in-flight counts are always current (extproc/scheduling/load.py adds the requests
routed since the last scrape to its queue).

The engine's side: a scrape costs the model server a render of its page, on the process that
also serves the requests (vLLM's API server renders its whole ~50 KB page, 7-8 ms of a core on
the 2-core development machine, whatever families are asked for: at 50 ms an idle engine spent
15.5% of its core, bench/results/vllm-scrape-cost.md). So each endpoint's own interval has a floor
that bounds the share of its server's time that the pickers' scrapes take:

    floor(e) = min(MAX_FLOOR_S, cost(e) x scrapers / engine_share)
    interval(e) = max(interval(n), floor(e))      (and a touched endpoint: max(base, floor(e)))

with cost(e) the shortest of the endpoint's last COST_WINDOW (8) scrape durations as the picker
measures them (GET sent to page read), `engine_share` = --scrape-engine-share (2% by default; 0:
no floor) and `scrapers` the picker processes scraping the same engines (this one, its sibling
workers and the peers it syncs with; `set_scrapers`): the share is the pool's, not each
picker's. A 7 ms render is scraped every 350 ms by one picker, a 1 ms one keeps the base 50 ms.
The shortest, not a mean: a GET that waited behind the engine's own work, or behind the picker's
event loop, cost the engine no more CPU, and a mean would scrape a busy engine less often just
when its queue is the news. MAX_FLOOR_S (1 s) keeps every endpoint scraped at least once a second.

The plan is pure: the caller passes the clock's `now` and the scrapes' durations and runs the
scrapes (extproc/scraping/scraper.py); a scrape in progress is not due again until `done`.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

COST_WINDOW = 8  # cost(e) is the shortest of the endpoint's last COST_WINDOW scrape durations
MAX_FLOOR_S = 1.0  # the engine-share floor never holds an endpoint's interval above this


@dataclass(slots=True)
class _State:
    due: float  # when the endpoint is next due (inf while a scrape of it runs)
    started: float  # when its last scrape started (-inf: never)
    running: bool = False
    touched: bool = False
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=COST_WINDOW))  # its last scrape durations
    floor_s: float = 0.0  # the interval floor its cost sets (module docstring)


class ScrapePlan:
    def __init__(self, base_interval_s: float, budget_per_s: float, engine_share: float = 0.0) -> None:
        if base_interval_s <= 0 or budget_per_s < 0 or not 0 <= engine_share <= 1:
            raise ValueError("the scrape interval must be > 0, the budget >= 0 and the engine share in [0, 1]")
        self.base_interval_s = base_interval_s
        self.budget_per_s = budget_per_s
        self.engine_share = engine_share
        self.scrapers = 1  # picker processes scraping the same engines (set_scrapers)
        self._states: dict[str, _State] = {}
        self._heap: list[tuple[float, int, str]] = []  # (due, sequence, key); outdated entries skipped
        self._seq = 0
        self._next_start = float("-inf")  # the earliest time the pacing allows the next start

    def __len__(self) -> int:
        return len(self._states)

    def interval(self) -> float:
        """Seconds between two scrapes of one endpoint at the current pool size."""
        n = len(self._states)
        if self.budget_per_s == 0 or n == 0:
            return self.base_interval_s
        return max(self.base_interval_s, n / self.budget_per_s)

    def interval_of(self, key: str) -> float:
        """Seconds between two scrapes of `key`: the pool's interval, or its engine-share floor."""
        st = self._states.get(key)
        pool = self.interval()
        return pool if st is None or st.floor_s <= pool else st.floor_s

    def observe(self, key: str, seconds: float) -> None:
        """A scrape of `key` took `seconds` (sent to read): its cost, and so its floor."""
        st = self._states.get(key)
        if st is None or seconds < 0:
            return
        st.recent.append(seconds)
        st.floor_s = self._floor(st.recent)

    def set_scrapers(self, n: int) -> None:
        """`n` picker processes (this one included) scrape these engines and share engine_share."""
        n = max(1, n)
        if n != self.scrapers:
            self.scrapers = n
            for st in self._states.values():
                st.floor_s = self._floor(st.recent)

    def _floor(self, recent: deque[float]) -> float:
        cost_s = min(recent, default=0.0)
        if self.engine_share == 0.0 or cost_s == 0.0:
            return 0.0
        return min(MAX_FLOOR_S, cost_s * self.scrapers / self.engine_share)

    def spacing(self) -> float:
        """Seconds between two scrape starts, pool-wide."""
        return self.interval() / max(len(self._states), 1)

    def rate(self) -> float:
        """Scrapes per second the whole pool gets."""
        return len(self._states) / self.interval()

    def _push(self, key: str, st: _State, due: float) -> None:
        st.due = due
        self._seq += 1
        heapq.heappush(self._heap, (due, self._seq, key))

    def add(self, key: str, now: float) -> None:
        if key not in self._states:
            st = _State(due=now, started=float("-inf"))
            self._states[key] = st
            self._push(key, st, now)

    def remove(self, key: str) -> None:
        self._states.pop(key, None)  # its heap entries are skipped when they surface

    def touch(self, key: str) -> None:
        """The picker routed a request to `key`: due `base` (or its floor) after its last scrape started."""
        st = self._states.get(key)
        if st is None or st.touched:
            return
        st.touched = True
        if not st.running:
            due = st.started + max(self.base_interval_s, st.floor_s)
            if due < st.due:
                self._push(key, st, due)

    def _top(self) -> tuple[float, str] | None:
        while self._heap:
            due, _, key = self._heap[0]
            st = self._states.get(key)
            if st is not None and not st.running and st.due == due:
                return due, key
            heapq.heappop(self._heap)
        return None

    def wait(self, now: float) -> float | None:
        """Seconds until the next scrape may start (0: now); None when nothing is planned."""
        top = self._top()
        if top is None:
            return None
        return max(top[0], self._next_start, now) - now

    def start(self, now: float) -> str | None:
        """The endpoint to scrape now, marked running; None when none is due or the pacing says wait."""
        top = self._top()
        if top is None or top[0] > now or self._next_start > now:
            return None
        heapq.heappop(self._heap)
        key = top[1]
        st = self._states[key]
        st.running, st.touched, st.started, st.due = True, False, now, float("inf")
        # A late loop is credited at most one missed slot, so starts never bunch up after a stall:
        # in any window of T seconds at most T / spacing + 2 scrapes start.
        spacing = self.spacing()
        credit = 0.0 if self._next_start == float("-inf") else spacing
        self._next_start = max(self._next_start, now - credit) + spacing
        return key

    def done(self, key: str, now: float) -> None:
        """The scrape of `key` ended: it is due again one interval (or, if touched, `base`) after it
        started, and never sooner than its floor."""
        st = self._states.get(key)
        if st is None or not st.running:
            return
        st.running = False
        step = self.base_interval_s if st.touched else self.interval()
        self._push(key, st, max(st.started + max(step, st.floor_s), now))
