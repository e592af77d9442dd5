"""The flow controller: holds requests while the pool is saturated and dispatches them in order.

`submit(request, dispatch)` is awaited by the request's stream once its body is complete, after
the objective's priority is known and before any scheduling (extproc/control/director.py `hold`):

1. Capacity, at arrival: the request's band (created from its template on first use) must have
   room for one more request and its bytes, and so must the global limits; else 429
   `rejected-saturated` at once.
2. Fast path: nothing is queued at its priority or above and the pool is not saturated ->
   `dispatch()` runs at once, in the caller, as without flow control.
3. Otherwise it joins its flow's queue and waits. The dispatcher (one task) runs a cycle whenever
   something may have changed: an arrival, a request's end (in-flight release), an endpoint's
   scrape or arrival (the datastore's change listener; no timer runs). A cycle dispatches one
   request at a time, yielding to the event loop in between, while the pool is not saturated:
   the bands from the highest priority down; the first band holding requests gives the next one
   (its fairness policy picks a flow, the ordering policy its head: extproc/flowcontrol/queues.py);
   a saturated pool stops the cycle, so a lower band never passes a blocked higher one.
   `dispatch()` runs in the dispatcher: it schedules the request on the endpoints of that moment
   below their own saturation (`with_room`; a held prompt's prefix counts then) and counts it in
   flight, so the next decision already sees it. Requests that take the fast path of 2. are
   scheduled among the endpoints with room too.
4. The wait ends at its deadline: the TTL (the band's or flowControl's defaultRequestTTL,
   shortened, never lengthened, by a valid `x-llm-d-inference-ttl`) while the pool has endpoints
   -> 429 `rejected-ttl-expired`; noEndpointRequestTTL while it has none -> 503
   `rejected-no-endpoints`. TTL 0: no deadline.
5. The client leaving cancels the waiting stream's task: the request leaves its queue at once.

Everything runs on the event loop; the queues hold only `Held` records (queues.py), and each
queue is bounded by its band's and the global limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from extproc.config.flow_control import FlowControlConfig, go_duration
from extproc.core.datastore import Datastore, Endpoint
from extproc.core.errors import EppError, ErrorCode
from extproc.flowcontrol import outcomes as O
from extproc.flowcontrol.detectors import Detector, with_room
from extproc.flowcontrol.queues import Band, Held

T = TypeVar("T")
log = logging.getLogger("prefix_epp.flowcontrol")
DEFAULT_FLOW = "default-flow"


class FlowObserver(Protocol):
    """Told how each request's time under flow control ended (extproc/telemetry/flow_control.py)."""

    def finished(self, fairness_id: str, priority: int, outcome: str, waited_s: float) -> None: ...


@dataclass(frozen=True, slots=True)
class FlowRequest:
    fairness_id: str
    priority: int
    size: int  # body bytes
    ttl_s: float | None = None  # from x-llm-d-inference-ttl; None: none sent


def flow_request(fairness_id: str, ttl: str, priority: int, size: int, max_chars: int) -> FlowRequest:
    """A request's flow from its headers' values ("" when absent); 400 for a value too long or a TTL
    that is no Go duration."""
    if len(fairness_id) > max_chars or len(ttl) > max_chars:
        raise EppError(ErrorCode.BAD_REQUEST, f"a flow-control header value exceeds {max_chars} characters")
    ttl_s = None
    if ttl:
        ttl_s = go_duration(ttl)
        if ttl_s is None:
            raise EppError(ErrorCode.BAD_REQUEST, "header x-llm-d-inference-ttl: expected a duration such as '5s'")
    return FlowRequest(fairness_id or DEFAULT_FLOW, priority, size, ttl_s)


class FlowController:
    def __init__(self, config: FlowControlConfig, datastore: Datastore, detector: Detector,
                 observer: FlowObserver | None = None) -> None:
        self.config = config
        self.detector = detector
        self._datastore = datastore
        self.observer = observer  # metrics (extproc/telemetry/flow_control.py), set once they exist
        self._bands: dict[int, Band] = {}
        self._priorities: list[int] = []  # of self._bands, highest first
        self._seq = 0
        self.count = 0  # held requests, all bands
        self.bytes = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        datastore.on_changed(self.wake)

    # -- the request's side ----------------------------------------------------------------------
    async def submit(self, request: FlowRequest, dispatch: Callable[[], T]) -> tuple[T, float]:
        """`dispatch()`'s result once it is the request's turn, and the seconds it waited; an
        EppError when refused or evicted (outcomes.py)."""
        if self._closed:
            raise O.shutting_down()
        cfg = self.config
        band = self._bands.get(request.priority)
        if band is None:
            band = Band(cfg.band(request.priority))
        if not band.has_room(request.size):
            self._finished(request, O.REJECTED_CAPACITY, 0.0)
            raise O.saturated(f"priority {request.priority}")
        if (cfg.max_requests and self.count + 1 > cfg.max_requests) or (
                cfg.max_bytes and self.bytes + request.size > cfg.max_bytes):
            self._finished(request, O.REJECTED_CAPACITY, 0.0)
            raise O.saturated("global")
        endpoints = self._datastore.snapshot()
        if not endpoints and cfg.no_endpoint_ttl_s == 0:
            self._finished(request, O.REJECTED_NO_ENDPOINTS, 0.0)
            raise O.no_endpoints(0.0)
        if not self._queued_from(request.priority) and self.detector.saturation(endpoints) < 1.0:
            result = dispatch()
            self._finished(request, O.DISPATCHED, 0.0)
            return result, 0.0
        loop = asyncio.get_running_loop()
        self._seq += 1
        held = Held(request.fairness_id, request.priority, self._seq, request.size, loop.time(), dispatch,
                    loop.create_future())
        self._enqueue(band, held)
        try:
            return await self._wait(held, band, request)
        except asyncio.CancelledError:
            if self._dequeue(held):
                self._finished(request, O.EVICTED_CANCELLED, loop.time() - held.enqueued)
            elif held.done.done() and not held.done.cancelled():
                held.done.exception()  # dispatched meanwhile: the stream's end releases what it took
            raise

    async def _wait(self, held: Held, band: Band, request: FlowRequest) -> tuple[T, float]:
        """Until dispatched (its result) or evicted at the deadline in force (EppError)."""
        loop = asyncio.get_running_loop()
        cfg = self.config
        ttl = cfg.ttl_s(band.config)
        if request.ttl_s is not None and request.ttl_s > 0 and (ttl == 0 or request.ttl_s < ttl):
            ttl = request.ttl_s  # the client may only ask to give up sooner
        no_ep = cfg.no_endpoint_ttl_s
        ttl_at = held.enqueued + ttl if ttl > 0 else None
        no_ep_at = held.enqueued + no_ep if no_ep > 0 else None
        while not held.done.done():
            now = loop.time()
            empty = not self._datastore.snapshot()
            deadline = no_ep_at if empty else ttl_at
            if deadline is not None and now >= deadline:
                self._dequeue(held)
                waited = now - held.enqueued
                self._finished(request, O.EVICTED_NO_ENDPOINTS if empty else O.EVICTED_TTL, waited)
                raise O.no_endpoints(waited) if empty else O.ttl_expired(waited)
            # Woken at the next deadline of either kind: whether the pool has endpoints may change meanwhile.
            later = [d for d in (ttl_at, no_ep_at) if d is not None and d > now]
            await asyncio.wait((held.done,), timeout=min(later) - now if later else None)
        result: tuple[T, float] = held.done.result()
        return result

    # -- the dispatcher ----------------------------------------------------------------------------
    def wake(self) -> None:
        """Something changed that may let a held request go (datastore change listener)."""
        if self.count and not self._closed:
            self._wake.set()
            if self._task is None:
                self._task = asyncio.get_running_loop().create_task(self._run(), name="flow-control-dispatch")

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._dispatch_one():
                await asyncio.sleep(0)  # one decision at a time: other streams run in between

    def _dispatch_one(self) -> bool:
        """Dispatch the next request if the pool has room; False when nothing (more) may go now."""
        if not self.count or self.detector.saturation(self._datastore.snapshot()) >= 1.0:
            return False
        band = self._bands[self._priorities[0]]  # empty bands are dropped: the highest holds requests
        held = band.next()
        self._dequeue(held)
        if held.done.done():
            return True
        waited = held.done.get_loop().time() - held.enqueued
        request = FlowRequest(held.fairness_id, held.priority, held.size)
        try:
            result = held.dispatch()
        except Exception as exc:  # the stream's own guard turns it into its 500
            held.done.set_exception(exc)
        else:
            held.done.set_result((result, waited))
        self._finished(request, O.DISPATCHED, waited)
        return True

    # -- queues ------------------------------------------------------------------------------------
    def _queued_from(self, priority: int) -> bool:
        """Whether a request of `priority` or higher is held (only bands holding requests are kept)."""
        return bool(self._priorities) and self._priorities[0] >= priority

    def _enqueue(self, band: Band, held: Held) -> None:
        if held.priority not in self._bands:
            self._bands[held.priority] = band
            self._priorities = sorted(self._bands, reverse=True)
        band.add(held)
        self.count += 1
        self.bytes += held.size
        self.wake()

    def _dequeue(self, held: Held) -> bool:
        band = self._bands.get(held.priority)
        if band is None or not band.remove(held):
            return False
        self.count -= 1
        self.bytes -= held.size
        if not band.count:
            del self._bands[held.priority]
            self._priorities = sorted(self._bands, reverse=True)
        return True

    def _finished(self, request: FlowRequest, outcome: str, waited_s: float) -> None:
        if self.observer is not None:
            self.observer.finished(request.fairness_id, request.priority, outcome, waited_s)

    # -- state for /metrics, and shutdown ---------------------------------------------------------
    def flows(self) -> Iterator[tuple[str, int, int, int]]:
        """(fairness id, priority, requests, bytes) of every flow holding requests."""
        for priority, band in list(self._bands.items()):
            for flow in list(band.flows.values()):
                yield flow.fairness_id, priority, len(flow.items), flow.bytes

    def saturation(self) -> float:
        return self.detector.saturation(self._datastore.snapshot())

    def with_room(self, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        """The candidates a request under flow control is scheduled among (detectors.py `with_room`)."""
        return with_room(self.detector, endpoints)

    async def close(self) -> None:
        """Stop dispatching; every held request gets 503 `rejected-shutting-down`."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for band in list(self._bands.values()):
            for held in list(band.order.values()):
                self._dequeue(held)
                if not held.done.done():
                    held.done.set_exception(O.shutting_down())
                    waited = held.done.get_loop().time() - held.enqueued
                    self._finished(FlowRequest(held.fairness_id, held.priority, held.size), O.EVICTED_OTHER, waited)
