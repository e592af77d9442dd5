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

The plan is pure: the caller passes the clock's `now` and runs the scrapes (extproc/scraping/
scraper.py); a scrape in progress is not due again until `done`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(slots=True)
class _State:
    due: float  # when the endpoint is next due (inf while a scrape of it runs)
    started: float  # when its last scrape started (-inf: never)
    running: bool = False
    touched: bool = False


class ScrapePlan:
    def __init__(self, base_interval_s: float, budget_per_s: float) -> None:
        if base_interval_s <= 0 or budget_per_s < 0:
            raise ValueError("the scrape interval must be > 0 and the budget >= 0")
        self.base_interval_s = base_interval_s
        self.budget_per_s = budget_per_s
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
        """The picker routed a request to `key`: due `base` after its last scrape started."""
        st = self._states.get(key)
        if st is None or st.touched:
            return
        st.touched = True
        if not st.running:
            due = st.started + self.base_interval_s
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
        """The scrape of `key` ended: it is due again one interval (or, if touched, `base`) after it started."""
        st = self._states.get(key)
        if st is None or not st.running:
            return
        st.running = False
        step = self.base_interval_s if st.touched else self.interval()
        self._push(key, st, max(st.started + step, now))
