"""One definition of an endpoint's load, shared by every load-aware plugin.

load = in-flight requests the picker routed there, plus, when a fresh scrape is available, the
engine's reported waiting queue. In-flight requests already counted by that scrape are not
counted twice: only those routed since the scrape (inflight - inflight_at_scrape) are added on
top of the scraped `waiting + running`. Without a usable scrape, load = in-flight.

Metric-based plugins (queue-scorer, kv-cache-utilization-scorer, lora-affinity-scorer,
utilization-detector) read `usable_metrics`: the last scrape if it succeeded and is at most
max(`staleness_s`, STALE_INTERVALS x its scrape interval) old, else None (the plugin then treats
the endpoint as saturated). The interval grows with the pool past the scrape budget
(extproc/scraping/plan.py: 512 ms at 256 endpoints, longer than the utilization-detector's
200 ms threshold), so a scrape counts as stale when the next one is overdue, not merely because
the pool is large. Their queue is `queue_depth`: the scraped waiting queue plus the requests
routed there since that scrape (or the picker's own requests there beyond the scraped running
ones, if more), so a slow or stale scrape cannot make every new request pile onto the pod that
looked idle.
"""

from __future__ import annotations

from extproc.core.datastore import Endpoint, ModelServerMetrics

STALE_INTERVALS = 2.0


def endpoint_load(ep: Endpoint) -> float:
    m = ep.metrics
    inflight = ep.inflight
    if m is None or not m.ok:
        return float(inflight)
    # max(inflight, scraped + routed_since_scrape(ep)), without the calls: read for every candidate.
    since = inflight - ep.inflight_at_scrape
    load = m.waiting + m.running + (since if since > 0 else 0)
    return load if load > inflight else float(inflight)


def usable_metrics(ep: Endpoint, now: float, staleness_s: float) -> ModelServerMetrics | None:
    """The endpoint's last scrape if it succeeded at most max(`staleness_s`, 2 intervals) before `now`."""
    m = ep.metrics
    if m is None or not m.ok or now - m.updated_at > max(staleness_s, STALE_INTERVALS * m.interval_s):
        return None
    return m


def routed_since_scrape(ep: Endpoint) -> int:
    """Requests routed to `ep` since its last successful scrape (not yet in the scraped queue)."""
    return max(ep.inflight - ep.inflight_at_scrape, 0)


def queue_depth(ep: Endpoint, m: ModelServerMetrics) -> float:
    """The larger of: the scraped waiting queue plus the requests routed to `ep` since that scrape;
    and the picker's own requests there that the scrape did not see running (in flight now minus
    the scraped `running`). The second covers what the first misses: requests routed before the
    scrape that had not reached the engine when it rendered its page are in `inflight_at_scrape`
    but not in its `waiting`; the first covers other pickers' requests, which only the engine sees."""
    own = ep.inflight - m.running
    scraped = m.waiting + routed_since_scrape(ep)
    return scraped if scraped >= own else float(own)
