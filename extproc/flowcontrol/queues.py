"""Flow queues, priority bands and their policies: which held request goes next.

A held request (`Held`) sits in the queue of its flow, keyed by (fairness id, priority). The
flows of one priority form a band (`Band`), which counts its requests and bytes against its
limits. Every queue is an insertion-ordered `OrderedDict` (arrival sequence -> request), so a
request whose client left is removed in O(1), not skipped later.

Within a band:
- the fairness policy picks a flow:
  - `global-strict-fairness-policy` (the default): the flow whose head arrived first, i.e. one
    queue in arrival order across all tenants, no isolation (the band keeps that order itself);
  - `round-robin-fairness-policy`: the active flows take turns, one dispatch each. A flow that
    becomes active (it held nothing before) takes the next turn, ahead of the flows already in
    the rotation (newcomers among themselves in the order they came), then joins the rotation's
    end; a flow that empties leaves the rotation. A tenant idle until now had no share of the
    turns taken meanwhile, so it is served at once rather than after every busy flow has gone
    once more: a light tenant beside a flood waits for one free slot, not two. A flow that stays
    busy gains nothing by it, since it becomes a newcomer only after emptying. The unit of
    fairness is a dispatch, not a token;
- the ordering policy picks the request within the flow: `fcfs-ordering-policy`, the oldest.

Memory: a flow or band exists only while it holds requests (the controller drops an empty band),
so the structures are bounded by the requests held.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from extproc.config.flow_control import FCFS, GLOBAL_STRICT, ROUND_ROBIN, BandConfig


@dataclass(slots=True, eq=False)
class Held:
    """One request waiting for its turn: what dispatch needs and nothing of the request itself
    (its body stays with its stream, charged to the body budget)."""

    fairness_id: str
    priority: int
    seq: int  # arrival order
    size: int  # body bytes
    enqueued: float  # loop time
    dispatch: Callable[[], Any]  # routes it (runs the scheduler), at its turn
    done: asyncio.Future[Any]  # dispatch's result, for the waiting stream


@dataclass(slots=True, eq=False)
class FlowQueue:
    fairness_id: str
    items: OrderedDict[int, Held] = field(default_factory=OrderedDict)
    bytes: int = 0


class FairnessPolicy(Protocol):
    name: str

    def pick(self, band: Band) -> FlowQueue: ...


class OrderingPolicy(Protocol):
    name: str

    def head(self, flow: FlowQueue) -> Held: ...


class GlobalStrict:
    """The flow of the oldest request of the band: one FCFS queue over every tenant."""

    name = GLOBAL_STRICT

    def pick(self, band: Band) -> FlowQueue:
        oldest = next(iter(band.order.values()))
        return band.flows[oldest.fairness_id]


class RoundRobin:
    """The active flows in turn: a newcomer first, else the first of the rotation, which then moves to its end."""

    name = ROUND_ROBIN

    def pick(self, band: Band) -> FlowQueue:
        if band.newcomers:
            fid, _ = band.newcomers.popitem(last=False)
            band.rotation[fid] = None  # served: at the rotation's end from now on
        else:
            fid = next(iter(band.rotation))
            band.rotation.move_to_end(fid)
        return band.flows[fid]


class Fcfs:
    name = FCFS

    def head(self, flow: FlowQueue) -> Held:
        return next(iter(flow.items.values()))


FAIRNESS: dict[str, Callable[[], FairnessPolicy]] = {GLOBAL_STRICT: GlobalStrict, ROUND_ROBIN: RoundRobin}
ORDERING: dict[str, Callable[[], OrderingPolicy]] = {FCFS: Fcfs}


class Band:
    """The flows of one priority; counts and limits its requests and bytes."""

    __slots__ = ("bytes", "config", "count", "fairness", "flows", "newcomers", "order", "ordering", "rotation")

    def __init__(self, config: BandConfig) -> None:
        self.config = config
        self.fairness = FAIRNESS[config.fairness]()
        self.ordering = ORDERING[config.ordering]()
        self.flows: dict[str, FlowQueue] = {}
        self.order: OrderedDict[int, Held] = OrderedDict()  # every request of the band, by arrival
        self.rotation: OrderedDict[str, None] = OrderedDict()  # active flows served before, next turn first
        self.newcomers: OrderedDict[str, None] = OrderedDict()  # active flows not served yet, by arrival
        self.count = 0
        self.bytes = 0

    def has_room(self, size: int) -> bool:
        c = self.config
        return self.count + 1 <= c.max_requests and self.bytes + size <= c.max_bytes

    def add(self, held: Held) -> None:
        flow = self.flows.get(held.fairness_id)
        if flow is None:
            flow = self.flows[held.fairness_id] = FlowQueue(held.fairness_id)
            self.newcomers[held.fairness_id] = None
        flow.items[held.seq] = held
        flow.bytes += held.size
        self.order[held.seq] = held
        self.count += 1
        self.bytes += held.size

    def remove(self, held: Held) -> bool:
        """Take `held` out of its queue; False if it was not there (already dispatched or evicted)."""
        if self.order.pop(held.seq, None) is None:
            return False
        flow = self.flows[held.fairness_id]
        del flow.items[held.seq]
        flow.bytes -= held.size
        self.count -= 1
        self.bytes -= held.size
        if not flow.items:
            del self.flows[held.fairness_id]
            if held.fairness_id in self.rotation:
                del self.rotation[held.fairness_id]
            else:
                del self.newcomers[held.fairness_id]
        return True

    def next(self) -> Held:
        """The request to dispatch next (the band holds at least one); it stays queued until removed."""
        return self.ordering.head(self.fairness.pick(self))
