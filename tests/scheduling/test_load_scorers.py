"""Metric-based scorers, the saturation detector and the default profile they join."""

from __future__ import annotations

from collections import Counter

import pytest

from extproc.config.settings import EppConfig, SaturationConfig
from extproc.core.datastore import Datastore, Endpoint, EndpointSpec, ModelServerMetrics
from extproc.core.errors import EppError, ErrorCode
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.build import Profile, build_scheduler
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.load import queue_depth, usable_metrics
from extproc.scheduling.saturation import UtilizationDetector
from extproc.scheduling.scorers.kv_cache import KvCacheScorer
from extproc.scheduling.scorers.lora import LoraAffinityScorer
from extproc.scheduling.scorers.queue import QueueScorer

NOW = 1000.0


def clock() -> float:
    return NOW


def endpoints(*metrics: ModelServerMetrics | None) -> list[Endpoint]:
    ds = Datastore()
    ds.set_endpoints([EndpointSpec("10.0.0.1", 8000 + i) for i in range(len(metrics))])
    eps = list(ds.snapshot())
    for ep, m in zip(eps, metrics, strict=True):
        if m is not None:
            ds.set_metrics(ep.key, m)
    return eps


def fresh(waiting: float = 0, running: float = 0, kv: float = 0.0, **kw: object) -> ModelServerMetrics:
    return ModelServerMetrics(waiting=waiting, running=running, kv_usage=kv, updated_at=NOW - 0.01, ok=True,
                              **kw)  # type: ignore[arg-type]


REQ = SchedulingRequest(request_id="r", model="m")


def test_queue_scorer_is_min_max_normalised_with_failed_and_stale_endpoints_saturated() -> None:
    failed = ModelServerMetrics(waiting=0, ok=False, updated_at=NOW)
    stale = fresh(0)
    stale.updated_at = NOW - 5
    eps = endpoints(fresh(2), fresh(6), fresh(4), failed, stale, None)
    assert QueueScorer(2.0, clock).score(REQ, eps) == [1.0, 0.0, 0.5, 0.0, 0.0, 0.0]
    assert QueueScorer(2.0, clock).score(REQ, endpoints(fresh(3), fresh(3))) == [1.0, 1.0]


def test_queue_counts_requests_routed_since_the_scrape() -> None:
    eps = endpoints(fresh(1), fresh(1))
    ds_ep = eps[0]
    ds_ep.inflight += 3  # routed after the scrape: not in its waiting queue yet
    assert queue_depth(ds_ep, fresh(1)) == 4
    assert QueueScorer(2.0, clock).score(REQ, eps) == [0.0, 1.0]


def test_queue_counts_requests_routed_before_the_scrape_that_it_did_not_see() -> None:
    """Six routed before the scrape, two of them still on their way to the engine when it rendered
    its page (4 running, 0 waiting): the queue is 2 at once, not only after the next scrape."""
    (ep,) = endpoints(None)
    ep.inflight = ep.inflight_at_scrape = 6
    assert queue_depth(ep, fresh(waiting=0, running=4)) == 2
    ep.inflight = 7  # one more since the scrape
    assert queue_depth(ep, fresh(waiting=0, running=4)) == 3
    ep.inflight = ep.inflight_at_scrape = 1  # other routers' requests: only the engine's queue shows them
    assert queue_depth(ep, fresh(waiting=5, running=4)) == 5


@pytest.mark.parametrize("profile", [Profile("queue-only", (), (("queue-scorer", 1.0),)), None])
def test_stale_scrapes_do_not_burst_onto_one_pod(profile: Profile | None) -> None:
    """No scrape lands while 30 requests are routed: the queue scorer alone still spreads them."""
    cfg = EppConfig(seed=3)
    ds = Datastore()
    ds.set_endpoints([EndpointSpec("10.0.0.1", 8000 + i) for i in range(3)])
    for ep in ds.snapshot():
        ds.set_metrics(ep.key, fresh(0))
    sched = build_scheduler(cfg, PrefixIndex(1000), profile, clock=clock)
    chosen: Counter[str] = Counter()
    for i in range(30):
        d = sched.schedule(SchedulingRequest(request_id=str(i), model="m"), ds.snapshot())
        ds.acquire(d.primary.key)
        chosen[d.primary.key] += 1
    assert max(chosen.values()) - min(chosen.values()) <= 1, chosen


def test_kv_cache_scorer() -> None:
    failed = ModelServerMetrics(kv_usage=0.1, ok=False)
    eps = endpoints(fresh(kv=0.25), fresh(kv=1.0), fresh(kv=0.0), failed)
    assert KvCacheScorer(2.0, clock).score(REQ, eps) == [0.75, 0.0, 1.0, 0.0]


def test_lora_affinity_scores() -> None:
    eps = endpoints(
        fresh(running_loras=frozenset({"m"}), max_lora=1),                      # active
        fresh(running_loras=frozenset({"x"}), max_lora=2),                      # free slot
        fresh(running_loras=frozenset({"x"}), waiting_loras=frozenset({"m"}), max_lora=2),  # waiting, full
        fresh(running_loras=frozenset({"x", "y"}), max_lora=2),                 # full, absent
        None,
    )
    assert LoraAffinityScorer(2.0, clock).score(REQ, eps) == [1.0, 0.8, 0.6, 0.0, 0.0]


def test_usable_metrics_window() -> None:
    ep = endpoints(fresh(1))[0]
    assert usable_metrics(ep, NOW, 2.0) is ep.metrics
    assert usable_metrics(ep, NOW + 2.5, 2.0) is None


def test_a_scrape_is_stale_past_two_of_its_intervals_when_that_is_longer_than_the_threshold() -> None:
    """256 endpoints at the default scrape budget are each scraped every 512 ms: a 400 ms old scrape
    is the last one, not a missing one, for the detector's 200 ms threshold; past two intervals it is
    stale."""
    ep = endpoints(fresh(1, interval_s=0.512))[0]
    assert usable_metrics(ep, NOW + 0.4, 0.2) is ep.metrics
    assert usable_metrics(ep, NOW + 1.05, 0.2) is None
    det = UtilizationDetector(SaturationConfig(), clock)
    assert det.endpoint_saturation(ep, NOW + 0.4) == pytest.approx(0.2)  # 1 waiting / 5, not saturated
    small = endpoints(fresh(1, interval_s=0.05))[0]  # a small pool: the threshold rules
    assert usable_metrics(small, NOW + 0.25, 0.2) is None


def test_detector_formula_staleness_and_average() -> None:
    det = UtilizationDetector(SaturationConfig(), clock)
    old = fresh(0)
    old.updated_at = NOW - 0.5  # older than 200 ms
    eps = endpoints(fresh(waiting=2, kv=0.4), fresh(waiting=0, kv=0.72), old, None)
    assert det.endpoint_saturation(eps[0], NOW) == pytest.approx(0.5)  # max(2/5, 0.4/0.8)
    assert det.endpoint_saturation(eps[1], NOW) == pytest.approx(0.9)
    assert det.endpoint_saturation(eps[2], NOW) == 1.0 and det.endpoint_saturation(eps[3], NOW) == 1.0
    assert det.saturation(eps) == pytest.approx((0.5 + 0.9 + 1 + 1) / 4)
    assert det.saturation([]) == 1.0
    eps[0].inflight = 5  # routed since the scrape: (2 + 5) / 5
    assert det.endpoint_saturation(eps[0], NOW) == pytest.approx(1.4)


def test_admission_sheds_only_sheddable_requests_while_saturated() -> None:
    det = UtilizationDetector(SaturationConfig(), clock)
    calm = endpoints(fresh(1, kv=0.1), fresh(0, kv=0.2))
    busy = endpoints(fresh(6, kv=0.5), fresh(5, kv=0.9))
    sheddable = SchedulingRequest(request_id="s", model="m", priority=-1)
    critical = SchedulingRequest(request_id="c", model="m", priority=5)
    det.admit(sheddable, calm)
    det.admit(critical, busy)
    det.admit(REQ, busy)
    with pytest.raises(EppError) as err:
        det.admit(sheddable, busy)
    assert err.value.code is ErrorCode.RESOURCE_EXHAUSTED and err.value.http_status == 429
    # headroom lets the pool run that much above saturation before sheddable requests are refused
    roomy = UtilizationDetector(SaturationConfig(headroom=0.5), clock)
    assert 1.0 <= roomy.saturation(busy) < 1.5
    roomy.admit(sheddable, busy)


def test_detector_as_filter_drops_stale_and_saturated_but_never_all() -> None:
    det = UtilizationDetector(SaturationConfig(headroom=0.2), clock)
    eps = endpoints(fresh(5, kv=0.1), fresh(6, kv=0.1), None, fresh(0))
    assert det.filter(REQ, eps) == [eps[0], eps[3]]  # 1.0 < 1.2 kept; 1.2 dropped; stale dropped
    assert det.filter(REQ, eps[1:3]) == eps[1:3]
    with pytest.raises(ValueError):
        UtilizationDetector(SaturationConfig(kv_cache_util_threshold=1.5))


def test_weighted_profile_weights_and_explanation() -> None:
    sched = build_scheduler(EppConfig(scheduler="weighted"), PrefixIndex(100), clock=clock)
    assert [f.name for f in sched.filters] == ["hot-spot-spill-filter"]
    assert [(w.scorer.name, w.weight) for w in sched.scorers] == [
        ("prefix-cache-scorer", 5.0), ("queue-scorer", 2.0), ("kv-cache-utilization-scorer", 2.0),
        ("inflight-load-scorer", 1.0)]
    eps = endpoints(fresh(4, kv=0.5), fresh(0, kv=0.1))
    d = sched.schedule(SchedulingRequest(request_id="x", model="m"), eps)
    assert d.primary is eps[1]
    assert "queue-scorer=1.000" in d.explain() and "kv-cache-utilization-scorer=0.900" in d.explain()
