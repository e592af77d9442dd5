"""The flow controller on a real datastore: when a request waits, in which order held requests go,
the limits, the TTLs, the client leaving, and the saturation credit between scrapes.

Dispatch here "routes" as the director does, on the datastore: the least loaded endpoint is
counted in flight, and `finish` releases it (a response's end).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import pytest

from extproc.config.flow_control import ROUND_ROBIN, BandConfig, FlowControlConfig
from extproc.config.settings import SaturationConfig
from extproc.core.datastore import Datastore, Endpoint, EndpointSpec, ModelServerMetrics
from extproc.core.errors import EppError
from extproc.flowcontrol import outcomes as O
from extproc.flowcontrol.controller import FlowController, FlowRequest, flow_request
from extproc.flowcontrol.detectors import ConcurrencyDetector, Detector
from extproc.scheduling.saturation import UtilizationDetector


class Pool:
    """A datastore of `n` endpoints and the order in which requests were dispatched."""

    def __init__(self, n: int) -> None:
        self.ds = Datastore()
        self.ds.set_endpoints([EndpointSpec("10.0.0.1", 8000 + i) for i in range(n)])
        self.order: list[str] = []
        self.outcomes: list[tuple[str, int, str]] = []

    def hold(self, fc: FlowController, request: FlowRequest, name: str) -> asyncio.Task[tuple[Endpoint, float]]:
        """Submit in a task of its own (a stream that waits)."""
        task = asyncio.create_task(fc.submit(request, self.route(name)))
        _tasks.append(task)
        return task

    def route(self, name: str) -> Callable[[], Endpoint]:
        def dispatch() -> Endpoint:
            ep = min(self.ds.snapshot(), key=lambda e: e.inflight)
            self.ds.acquire(ep.key)
            self.order.append(name)
            return ep
        return dispatch

    async def next_after(self, action: Callable[[], None]) -> None:
        """Run `action`, then wait for the next dispatch."""
        done = len(self.order)
        action()
        await until(lambda: len(self.order) > done)

    def finish(self, ep: Endpoint) -> None:
        self.ds.release(ep)

    def finished(self, fairness_id: str, priority: int, outcome: str, waited_s: float) -> None:
        self.outcomes.append((fairness_id, priority, outcome))


_controllers: list[FlowController] = []
_tasks: list[asyncio.Task[tuple[Endpoint, float]]] = []


def controller(pool: Pool, detector: Detector | None = None, **kw: object) -> FlowController:
    cfg = replace(FlowControlConfig(enabled=True), **kw)  # type: ignore[arg-type]
    fc = FlowController(cfg, pool.ds, detector or ConcurrencyDetector(1), pool)
    _controllers.append(fc)
    return fc


@pytest.fixture(autouse=True)
async def _close_controllers() -> AsyncIterator[None]:
    """Requests a test leaves held end with the test (503), not at their 60 s TTL."""
    yield
    while _controllers:
        await _controllers.pop().close()
    await asyncio.gather(*_tasks, return_exceptions=True)
    _tasks.clear()


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition never held")
        await asyncio.sleep(0.001)


def req(fid: str = "t", priority: int = 0, size: int = 10, ttl: float | None = None) -> FlowRequest:
    return FlowRequest(fid, priority, size, ttl)


async def test_an_unsaturated_pool_dispatches_at_once_and_a_saturated_one_holds_until_a_slot_frees() -> None:
    pool = Pool(2)
    fc = controller(pool)  # 1 request per endpoint: 2 in flight saturate the pool
    first, waited = await fc.submit(req(), pool.route("a"))
    await fc.submit(req(), pool.route("b"))
    assert waited == 0.0 and pool.order == ["a", "b"] and fc.count == 0
    third = pool.hold(fc, req(), "c")
    await until(lambda: fc.count == 1)
    assert pool.order == ["a", "b"] and not third.done()
    pool.finish(first)  # the response's end wakes the dispatcher: no timer
    ep, waited = await asyncio.wait_for(third, 5)
    assert pool.order == ["a", "b", "c"] and ep.key == first.key and waited > 0 and fc.count == 0
    assert [o for _, _, o in pool.outcomes] == [O.DISPATCHED] * 3


async def one_by_one(pool: Pool, n: int) -> None:
    """Free the single endpoint's slot `n` times, each time waiting for the next dispatch."""
    for _ in range(n):
        await pool.next_after(lambda: pool.finish(pool.ds.snapshot()[0]))


async def test_bands_go_highest_priority_first_whatever_the_arrival_order() -> None:
    pool = Pool(1)
    fc = controller(pool)
    await fc.submit(req(), pool.route("busy"))
    for fid, prio in (("low", -5), ("mid", 0), ("high", 10), ("mid2", 0)):
        pool.hold(fc, req(fid, prio), fid)
    await until(lambda: fc.count == 4)
    await one_by_one(pool, 4)
    assert pool.order == ["busy", "high", "mid", "mid2", "low"]


async def test_a_new_arrival_never_passes_requests_held_at_its_priority_or_above() -> None:
    pool = Pool(1)
    fc = controller(pool)
    await fc.submit(req(), pool.route("busy"))
    pool.hold(fc, req("x", 5), "held")
    await until(lambda: fc.count == 1)
    later = pool.hold(fc, req("y", 0), "later")
    await until(lambda: fc.count == 2)
    await one_by_one(pool, 2)
    assert pool.order == ["busy", "held", "later"] and later.done()


@pytest.mark.parametrize(("fairness", "expected"), [
    ("global-strict-fairness-policy", ["a1", "a2", "a3", "b1", "c1"]),
    (ROUND_ROBIN, ["a1", "b1", "c1", "a2", "a3"]),
])
async def test_within_a_band_the_fairness_policy_picks_the_flow(fairness: str, expected: list[str]) -> None:
    pool = Pool(1)
    fc = controller(pool, default_band=BandConfig(fairness=fairness))
    await fc.submit(req(), pool.route("busy"))
    for name in ("a1", "a2", "a3", "b1", "c1"):
        pool.hold(fc, req(name[0]), name)
    await until(lambda: fc.count == 5)
    await one_by_one(pool, 5)
    assert pool.order[1:] == expected


async def test_round_robin_lets_a_light_tenant_pass_a_heavy_one_s_backlog() -> None:
    pool = Pool(1)
    fc = controller(pool, default_band=BandConfig(fairness=ROUND_ROBIN))
    await fc.submit(req(), pool.route("busy"))
    for i in range(20):
        pool.hold(fc, req("heavy"), f"heavy{i}")
    await until(lambda: fc.count == 20)
    await one_by_one(pool, 3)
    pool.hold(fc, req("light"), "light")
    await until(lambda: fc.count == 18)
    await one_by_one(pool, 2)
    assert pool.order[-2:] == ["light", "heavy3"]  # a tenant that was idle takes the next turn


async def test_round_robin_newcomers_go_in_their_order_and_a_busy_flow_gains_nothing() -> None:
    pool = Pool(1)
    fc = controller(pool, default_band=BandConfig(fairness=ROUND_ROBIN))
    await fc.submit(req(), pool.route("busy"))
    for name in ("a1", "a2", "a3", "a4"):
        pool.hold(fc, req("a"), name)
    await until(lambda: fc.count == 4)
    await one_by_one(pool, 1)  # a1: a's first turn
    for name in ("b1", "c1", "b2"):
        pool.hold(fc, req(name[0]), name)
    await until(lambda: fc.count == 6)
    await one_by_one(pool, 6)
    # b and c came after a was served: each goes once before a again, in the order they came;
    # then the rotation runs as usual (b still held a request, so it is no newcomer any more).
    assert pool.order[1:] == ["a1", "b1", "c1", "a2", "b2", "a3", "a4"]


@pytest.mark.parametrize(("kw", "size", "where"), [
    ({"default_band": BandConfig(max_requests=2)}, 10, "priority 0"),
    ({"default_band": BandConfig(max_bytes=25)}, 10, "priority 0"),
    ({"max_requests": 2}, 10, "global"),
    ({"max_bytes": 25}, 10, "global"),
])
async def test_a_full_band_or_global_queue_refuses_with_429_rejected_saturated(
        kw: dict[str, Any], size: int, where: str) -> None:
    pool = Pool(1)
    fc = controller(pool, **kw)
    await fc.submit(req(size=size), pool.route("busy"))  # dispatched: not counted against the queue
    held = [pool.hold(fc, req(size=size), f"h{i}") for i in range(2)]
    await until(lambda: fc.count == 2)
    with pytest.raises(EppError) as err:
        await fc.submit(req(size=size), pool.route("refused"))
    assert err.value.http_status == 429 and err.value.dropped_reason == "rejected-saturated"
    assert where in err.value.message and fc.count == 2 and "refused" not in pool.order
    assert pool.outcomes[-1][2] == O.REJECTED_CAPACITY
    for t in held:
        t.cancel()


async def test_bands_of_listed_and_negative_priorities_have_their_own_limits() -> None:
    pool = Pool(1)
    fc = controller(pool, bands=(BandConfig(priority=7, max_requests=1),),
                    default_negative_band=BandConfig(max_requests=1))
    await fc.submit(req(), pool.route("busy"))
    held = [pool.hold(fc, req(priority=prio), str(prio)) for prio in (7, -1, 0, 0)]
    await until(lambda: fc.count == 4)
    for prio in (7, -1):  # the listed band's limit, the negative template's
        with pytest.raises(EppError):
            await fc.submit(req(priority=prio), pool.route("refused"))
    assert fc.count == 4
    await fc.close()
    await asyncio.gather(*held, return_exceptions=True)


async def test_a_request_held_past_its_ttl_gets_429_rejected_ttl_expired() -> None:
    pool = Pool(1)
    fc = controller(pool, default_request_ttl_s=0.2)
    await fc.submit(req(), pool.route("busy"))
    start = time.monotonic()
    with pytest.raises(EppError) as err:
        await fc.submit(req(), pool.route("late"))
    assert time.monotonic() - start >= 0.2
    assert err.value.http_status == 429 and err.value.dropped_reason == "rejected-ttl-expired"
    assert fc.count == 0 and pool.outcomes[-1][2] == O.EVICTED_TTL and pool.order == ["busy"]


async def test_the_ttl_header_only_shortens_the_wait() -> None:
    pool = Pool(1)
    fc = controller(pool, default_request_ttl_s=0.3, bands=(BandConfig(priority=1, request_ttl_s=0.1),))
    await fc.submit(req(), pool.route("busy"))
    for ttl, limit, priority in ((0.05, 0.05, 0), (5.0, 0.3, 0), (5.0, 0.1, 1)):
        start = time.monotonic()
        with pytest.raises(EppError):
            await fc.submit(req(ttl=ttl, priority=priority), pool.route("late"))
        waited = time.monotonic() - start
        assert limit <= waited < limit + 1.0, (ttl, limit, waited)


async def test_without_endpoints_a_request_waits_for_one_then_gets_503_rejected_no_endpoints() -> None:
    pool = Pool(0)
    fc = controller(pool, default_request_ttl_s=5.0, no_endpoint_request_ttl_s=0.1)
    with pytest.raises(EppError) as err:
        await fc.submit(req(), pool.route("x"))
    assert err.value.http_status == 503 and err.value.dropped_reason == "rejected-no-endpoints"
    assert pool.outcomes[-1][2] == O.EVICTED_NO_ENDPOINTS
    # An endpoint that arrives while it waits takes it.
    waiting = pool.hold(fc, req(), "y")
    await until(lambda: fc.count == 1)
    pool.ds.upsert(EndpointSpec("10.0.0.9", 8000))
    ep, _ = await asyncio.wait_for(waiting, 5)
    assert ep.key == "10.0.0.9:8000" and pool.order == ["y"]


async def test_no_endpoint_ttl_zero_refuses_at_once() -> None:
    pool = Pool(0)
    fc = controller(pool, no_endpoint_request_ttl_s=0.0)
    with pytest.raises(EppError) as err:
        await fc.submit(req(), pool.route("x"))
    assert err.value.http_status == 503 and pool.outcomes[-1][2] == O.REJECTED_NO_ENDPOINTS


async def test_a_client_that_leaves_takes_its_request_out_of_the_queue_at_once() -> None:
    pool = Pool(1)
    fc = controller(pool)
    await fc.submit(req(), pool.route("busy"))
    gone = pool.hold(fc, req("gone", size=100), "gone")
    stays = pool.hold(fc, req("stays"), "stays")
    await until(lambda: fc.count == 2)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert fc.count == 1 and fc.bytes == 10 and [f[0] for f in fc.flows()] == ["stays"]
    assert ("gone", 0, O.EVICTED_CANCELLED) in pool.outcomes
    await one_by_one(pool, 1)
    assert pool.order == ["busy", "stays"] and stays.done()


async def test_closing_answers_every_held_request_with_503() -> None:
    pool = Pool(1)
    fc = controller(pool)
    await fc.submit(req(), pool.route("busy"))
    held = pool.hold(fc, req(), "held")
    await until(lambda: fc.count == 1)
    await fc.close()
    with pytest.raises(EppError) as err:
        await held
    assert err.value.http_status == 503 and err.value.dropped_reason == "rejected-shutting-down"
    with pytest.raises(EppError):
        await fc.submit(req(), pool.route("after"))


def scrape(ds: Datastore, ep: Endpoint, waiting: float, running: float = 0) -> None:
    ds.set_metrics(ep.key, ModelServerMetrics(waiting=waiting, running=running, ok=True,
                                              updated_at=time.monotonic(), interval_s=60.0))


async def test_the_utilization_gate_credits_dispatches_since_the_last_scrape() -> None:
    # One endpoint, queueDepthThreshold 3: a scrape that shows 1 waiting leaves room for two more.
    # Without the credit, every request until the next scrape would pass the stale reading.
    pool = Pool(1)
    fc = controller(pool, UtilizationDetector(SaturationConfig(queue_depth_threshold=3,
                                                               metrics_staleness_threshold_s=60.0)))
    ep = pool.ds.snapshot()[0]
    scrape(pool.ds, ep, 1)
    for name in ("a", "b", "c", "d"):
        pool.hold(fc, req(), name)
    await until(lambda: fc.count == 2)
    assert pool.order == ["a", "b"]
    scrape(pool.ds, ep, 0, running=2)  # the engine admitted its queue: the scrape wakes the dispatcher
    await until(lambda: fc.count == 0)
    assert pool.order == ["a", "b", "c", "d"]


async def test_the_utilization_gate_counts_requests_the_scrape_did_not_see_arrive() -> None:
    # queueDepthThreshold 3; three dispatched, then a scrape shows 1 running and none waiting: two
    # were still on their way to the engine, so the queue is 2 and only one more goes.
    pool = Pool(1)
    fc = controller(pool, UtilizationDetector(SaturationConfig(queue_depth_threshold=3,
                                                               metrics_staleness_threshold_s=60.0)))
    ep = pool.ds.snapshot()[0]
    scrape(pool.ds, ep, 0)
    for name in ("a", "b", "c", "d", "e"):
        pool.hold(fc, req(), name)
    await until(lambda: fc.count == 2)  # the credit alone: three since the scrape
    scrape(pool.ds, ep, 0, running=1)  # taken after "c": it saw one of the three arrive
    assert fc.saturation() == 2 / 3  # without the picker's own count: 0, and both would go
    await until(lambda: fc.count == 1 and not fc._wake.is_set())  # the scrape's dispatch cycle ran
    assert pool.order == ["a", "b", "c", "d"] and fc.saturation() == 1.0
    scrape(pool.ds, ep, 0, running=3)
    await until(lambda: fc.count == 0)


async def test_a_stale_endpoint_counts_as_saturated() -> None:
    pool = Pool(1)
    fc = controller(pool, UtilizationDetector(SaturationConfig(metrics_staleness_threshold_s=0.05)))
    ep = pool.ds.snapshot()[0]
    pool.ds.set_metrics(ep.key, ModelServerMetrics(ok=True, updated_at=time.monotonic() - 10, interval_s=0.01))
    held = pool.hold(fc, req(), "held")
    await until(lambda: fc.count == 1)
    scrape(pool.ds, ep, 0)
    await asyncio.wait_for(held, 5)
    assert pool.order == ["held"]


def test_flow_headers_are_bounded_and_checked() -> None:
    r = flow_request("", "", 3, 10, 256)
    assert (r.fairness_id, r.priority, r.ttl_s) == ("default-flow", 3, None)
    assert flow_request("tenant-a", "1m30s", 0, 10, 256).ttl_s == 90.0
    for fid, ttl in (("x" * 257, ""), ("a", "soon"), ("a", "9" * 300)):
        with pytest.raises(EppError) as err:
            flow_request(fid, ttl, 0, 10, 256)
        assert err.value.http_status == 400
