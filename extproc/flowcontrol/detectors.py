"""Saturation detectors of flow control: how full the pool is, 0 (idle) to 1 (saturated) and beyond.

Dispatch stops while the pool's saturation is >= 1 (every band's ceiling, as llm-d's default
usage limit); a pool without endpoints is saturated (fail closed).

- `utilization-detector` (the default; extproc/scheduling/saturation.py, parameters in
  SaturationConfig): the average over endpoints of
  max(queue / queueDepthThreshold, kv / kvCacheUtilThreshold), where queue is the scraped waiting
  queue plus the requests routed to the endpoint since that scrape (extproc/scheduling/load.py):
  what was dispatched between two scrapes is credited at once, so dispatch cannot overshoot the
  threshold while the scrape lags. An endpoint without a fresh scrape counts as saturated (1.0).
- `concurrency-detector`: the picker's own count of requests in flight over the pool's capacity,
  sum(in flight) / (endpoints x maxConcurrency). Exact at every instant (no scrape involved), so
  it needs no credit; an engine's own queue is invisible to it.

Either costs one pass over the endpoints per dispatch decision.

Per endpoint (`with_room`): a request under flow control is scheduled only among the endpoints
below their own saturation (utilization: s(e) < 1; concurrency: in flight < maxConcurrency), all
of them if none is. The gate is the pool's average, so without this a scheduler that weighs cache
affinity above load could pile one engine past its threshold while another had room; with it each
engine stays within its threshold plus the one request that crosses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from extproc.config.flow_control import CONCURRENCY, UTILIZATION, FlowControlConfig
from extproc.config.settings import SaturationConfig
from extproc.core.datastore import Endpoint
from extproc.scheduling.saturation import UtilizationDetector


class Detector(Protocol):
    name: str

    def saturation(self, endpoints: Sequence[Endpoint]) -> float: ...

    def has_room(self, endpoint: Endpoint) -> bool: ...


def with_room(detector: Detector, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
    """The endpoints below their own saturation; all of them when none is."""
    room = [ep for ep in endpoints if detector.has_room(ep)]
    return room or list(endpoints)


class ConcurrencyDetector:
    name = CONCURRENCY

    def __init__(self, max_concurrency: int) -> None:
        if max_concurrency < 1:
            raise ValueError("concurrency-detector: maxConcurrency must be >= 1")
        self.max_concurrency = max_concurrency

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        if not endpoints:
            return 1.0
        return sum(ep.inflight for ep in endpoints) / (len(endpoints) * self.max_concurrency)

    def has_room(self, endpoint: Endpoint) -> bool:
        return endpoint.inflight < self.max_concurrency


def make_detector(config: FlowControlConfig, saturation: SaturationConfig) -> Detector:
    """The detector `flowControl.saturationDetector` names."""
    if config.detector == CONCURRENCY:
        return ConcurrencyDetector(config.concurrency.max_concurrency)
    if config.detector == UTILIZATION:
        return UtilizationDetector(saturation)
    raise ValueError(f"unknown saturation detector {config.detector!r}")
