"""Which endpoints are in rotation: failing replicas out, probed back, fail open when none is left.

Every scheduler picks among the candidates this returns (`Rotation.candidates`, called by the
director after the subset hint), so the rule holds for the built-in profiles, a profile from an
EndpointPickerConfig and the reference policies alike. An endpoint is out of rotation while

- its metrics scrape fails: refused, timed out (--scrape-timeout), an error page
  (`ModelServerMetrics.ok` False): a killed, frozen or unreachable engine, or a Ready pod whose
  engine hangs or restarts. It is back with its next successful scrape. An endpoint not scraped
  yet is in rotation (a new pod is not held back by the scraper's first pass); so is every
  endpoint when scraping is off;
- it is ejected, as Envoy's outlier detection does (consecutive_5xx): `consecutive_failures`
  (--outlier-consecutive-failures, 3; 0: never) requests routed there in a row ended badly
  (`outcome(ep, ok=False)`: a 5xx the client got, an upstream reset or a failed connection, or a
  fallback that served the request instead). The ejection lasts `base_ejection_s` x 2^(n-1)
  (--outlier-ejection-time, 2 s) for its n-th ejection in a row, at most `max_ejection_s` (30 s).
  Then the endpoint is a candidate again on probation: one more failure ejects it again at once,
  for the next back-off; a success ends the probation and the back-off count.

If no candidate is left in rotation, all of them are candidates (fail open: routing by load beats
refusing every request when the health signal itself may be what failed, e.g. engines that
export no /metrics); each such decision is counted (prefix_epp_fail_open_decisions_total) and a
warning is logged once per episode. Error responses never feed learning: the director tells the
scheduler the request failed (`Scheduler.finished(..., ok=False)`), which releases what it holds
without learning latency or cache contents from it.

State is kept per endpoint key only for endpoints with failures, and dropped when discovery
removes the endpoint; the request path reads one attribute per candidate and a dict that is empty
while nothing has failed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from extproc.config.settings import OutlierConfig
from extproc.core.datastore import Datastore, Endpoint

log = logging.getLogger("prefix_epp.health")


@dataclass(slots=True)
class _Record:
    failures: int = 0  # consecutive failed outcomes
    ejections: int = 0  # consecutive ejections (the back-off's exponent)
    until: float = 0.0  # ejected until (monotonic seconds); 0: not ejected


class Rotation:
    def __init__(self, config: OutlierConfig, datastore: Datastore,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._datastore = datastore
        self._clock = clock
        self._records: dict[str, _Record] = {}
        self._ejected: dict[str, float] = {}  # key -> ejected until; empty while nothing is ejected
        self.fail_open_decisions = 0
        self.ejections_total = 0
        self._failing_open = False
        datastore.on_removed(self._removed)

    def _removed(self, ep: Endpoint) -> None:
        self._records.pop(ep.key, None)
        self._ejected.pop(ep.key, None)

    # -- the request path ----------------------------------------------------------------------
    def candidates(self, endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        """The endpoints in rotation, in their order; all of them when none is (fail open)."""
        ejected = self._ejected
        if ejected:
            now = self._clock()
            for key in [k for k, until in ejected.items() if until <= now]:
                del ejected[key]  # probation: its record keeps failures one short of the threshold
        kept = [ep for ep in endpoints if self._in_rotation(ep, ejected)]
        if len(kept) == len(endpoints):
            if self._failing_open:
                self._failing_open = False
                log.info("an endpoint is back in rotation; failing open ended")
            return endpoints
        if kept:
            return kept
        self.fail_open_decisions += 1
        if not self._failing_open:
            self._failing_open = True
            log.warning("every candidate endpoint is failing (scrapes or responses); routing by load among all",
                        extra={"endpoints": len(endpoints)})
        return endpoints

    @staticmethod
    def _in_rotation(ep: Endpoint, ejected: dict[str, float]) -> bool:
        m = ep.metrics
        return (m is None or m.ok) and ep.key not in ejected

    def in_rotation(self, ep: Endpoint) -> bool:
        """Whether `ep` is a candidate now (for the metrics; not on the request path)."""
        until = self._ejected.get(ep.key)
        return (ep.metrics is None or ep.metrics.ok) and (until is None or until <= self._clock())

    # -- outcomes (the response's end) ---------------------------------------------------------
    def outcome(self, ep: Endpoint, ok: bool) -> None:
        """A request routed to `ep` ended: `ok` False for a 5xx, a reset or a failed connection."""
        records = self._records
        if ok:
            if ep.key in records and ep.key not in self._ejected:
                del records[ep.key]  # a success ends the probation and the back-off
            return
        threshold = self.config.consecutive_failures
        if threshold <= 0 or ep.key in self._ejected:
            return
        rec = records.get(ep.key)
        if rec is None:
            if self._datastore.get(ep.key) is not ep:
                return  # left the pool meanwhile: no record for a key discovery already forgot
            rec = records[ep.key] = _Record()
        rec.failures += 1
        if rec.failures < threshold:
            return
        rec.ejections += 1
        seconds = min(self.config.max_ejection_s, self.config.base_ejection_s * 2 ** (rec.ejections - 1))
        rec.until = self._clock() + seconds
        rec.failures = threshold - 1  # after the back-off, one more failure ejects it again
        self._ejected[ep.key] = rec.until
        self.ejections_total += 1
        log.warning("endpoint ejected after failed responses", extra={
            "endpoint": ep.key, "consecutive_failures": threshold, "ejection_s": seconds,
            "ejections_in_a_row": rec.ejections})
