"""One definition of an endpoint's load, shared by every load-aware plugin.

load = in-flight requests the picker routed there, plus, when a fresh scrape is available, the
engine's reported waiting queue. In-flight requests already counted by that scrape are not
counted twice: only those routed since the scrape (inflight - inflight_at_scrape) are added on
top of the scraped `waiting + running`. Without a usable scrape, load = in-flight.
"""

from __future__ import annotations

from extproc.datastore import Endpoint


def endpoint_load(ep: Endpoint) -> float:
    m = ep.metrics
    if m is None or not m.ok:
        return float(ep.inflight)
    since_scrape = ep.inflight - ep.inflight_at_scrape
    return max(float(ep.inflight), m.waiting + m.running + max(since_scrape, 0))
