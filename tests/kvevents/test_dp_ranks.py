"""Data-parallel ranks: an InferencePool target port's rank picks its KV-event ports, and each batch
goes to the endpoint of the rank it names (extproc/kvevents/manager.py, subscriber.py).

The publishers are real ZeroMQ sockets on the ports vLLM's ranks bind (base + rank), sending
batches in the engines' wire format (`[ts, events, data_parallel_rank]`), to a running manager.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import zmq.asyncio

from extproc.config.settings import KVEventsConfig
from extproc.core.datastore import Datastore, Endpoint, EndpointSpec
from extproc.discovery.pool import V1_GROUP, parse_pod, parse_pool, pod_endpoints
from extproc.kvevents.keys import chain_keys, key_seed
from extproc.kvevents.manager import KVEventsManager
from extproc.kvevents.ranks import source_addresses
from testkit.kube import pod, pool_v1
from testkit.kvevents import FAST, RawPublisher, stored_batch, stored_tokens, wait_for
from testkit.procs import consecutive_free_ports

RANK0, RANK1 = "127.0.0.1:8000", "127.0.0.1:8001"


def pod_with_ranks(ports: list[int], annotations: dict[str, str] | None = None) -> list[EndpointSpec]:
    obj = pod("vllm-0", {"app": "v"}, ip="127.0.0.1")
    if annotations:
        obj["metadata"]["annotations"] = annotations
    return pod_endpoints(parse_pod(obj), parse_pool(pool_v1("p", {"app": "v"}, ports), V1_GROUP))


def endpoints(specs: list[EndpointSpec]) -> tuple[Endpoint, ...]:
    ds = Datastore()
    ds.set_endpoints(specs)
    return ds.snapshot()


def test_a_target_ports_rank_subscribes_to_the_base_ports_plus_its_rank() -> None:
    rank0, rank1 = endpoints(pod_with_ranks([8000, 8001]))
    assert (rank0.spec.rank, rank1.spec.rank) == (0, 1)
    cfg = KVEventsConfig(port=5557, replay_port=5600)
    assert [(a.rank, a.events, a.replay) for a in source_addresses(rank1, cfg)] == [
        (1, "tcp://127.0.0.1:5558", "tcp://127.0.0.1:5601")]
    assert [(a.rank, a.events) for a in source_addresses(rank0, cfg)] == [(0, "tcp://127.0.0.1:5557")]
    # Ranks behind one port each (--kv-events-dp-size 2): the second port holds ranks 2 and 3.
    assert [(a.rank, a.events, a.replay) for a in source_addresses(rank1, replace(cfg, dp_size=2))] == [
        (2, "tcp://127.0.0.1:5559", "tcp://127.0.0.1:5602"), (3, "tcp://127.0.0.1:5560", "tcp://127.0.0.1:5603")]
    # The pod's annotation names its rank-0 publisher (and replay): each rank offsets it.
    annotated = endpoints(pod_with_ranks([8000, 8001], {"prefix-epp.io/kv-events-endpoint": "6000@6100"}))
    assert [(a.events, a.replay) for ep in annotated for a in source_addresses(ep, KVEventsConfig())] == [
        ("tcp://127.0.0.1:6000", "tcp://127.0.0.1:6100"), ("tcp://127.0.0.1:6001", "tcp://127.0.0.1:6101")]
    # Static endpoints are rank 0: an explicit address is theirs as written.
    static = endpoints([EndpointSpec("127.0.0.1", 8001, kv_events_endpoint="tcp://127.0.0.1:7001")])
    assert [a.events for a in source_addresses(static[0], cfg)] == ["tcp://127.0.0.1:7001"]


def test_a_rank_whose_publisher_would_sit_on_a_replay_port_is_refused() -> None:
    rank0, rank1 = endpoints(pod_with_ranks([8000, 8001]))
    colliding = KVEventsConfig(port=5557, replay_port=5558)  # vLLM's rank 1 publishes on 5558
    assert [a.events for a in source_addresses(rank0, colliding)] == ["tcp://127.0.0.1:5557"]
    with pytest.raises(ValueError, match="port 5558 would be both"):
        source_addresses(rank1, colliding)
    with pytest.raises(ValueError, match="at least 4 ports"):
        source_addresses(rank1, replace(colliding, replay_port=5560, dp_size=2))
    assert KVEventsConfig().replay_port == 0  # the default: no replay socket, nothing to collide with


def held(m: KVEventsManager, first_hash: int, blocks: int = 4) -> dict[str, int]:
    keys = chain_keys(stored_tokens(first_hash, blocks), 16, key_seed(None), 64)
    found = m.index.match(keys, [RANK0, RANK1], m.now())
    return {ep: found.get(ep, 0) for ep in (RANK0, RANK1)}


@contextlib.asynccontextmanager
async def ranked_pod() -> AsyncIterator[tuple[KVEventsManager, list[RawPublisher]]]:
    """A pod of two ranks (targetPorts 8000, 8001) whose publishers bind base and base + 1, and a
    running manager subscribed to them."""
    base = consecutive_free_ports(2)
    ctx = zmq.asyncio.Context()
    pubs = [RawPublisher(ctx, f"tcp://127.0.0.1:{base + r}") for r in range(2)]
    ds = Datastore()
    ds.set_endpoints(pod_with_ranks([8000, 8001]))
    m = KVEventsManager(replace(FAST, port=base), ds)
    task = asyncio.create_task(m.run())
    try:
        for p in pubs:
            await p.subscribed()
        yield m, pubs
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for p in pubs:
            p.close()
        ctx.destroy(linger=0)


async def test_batches_go_to_the_endpoint_of_the_rank_they_name() -> None:
    async with ranked_pod() as (m, (pub0, pub1)):
        await pub1.publish(0, stored_batch(100, 4, rank=1))  # rank 1's port, tagged 1: vLLM's DP rank 1
        await wait_for(lambda: m.stats.messages == 1)
        assert held(m, 100) == {RANK0: 0, RANK1: 4}
        await pub1.publish(1, stored_batch(200, 4, rank=0))  # an engine without DP says 0 on any port
        await wait_for(lambda: m.stats.messages == 2)
        assert held(m, 200) == {RANK0: 0, RANK1: 4}
        await pub0.publish(0, stored_batch(300, 4, rank=1))  # rank 0's port naming rank 1: rank 1's blocks
        await wait_for(lambda: m.stats.messages == 3)
        assert held(m, 300) == {RANK0: 0, RANK1: 4} and m.stats.other_rank == {"attributed": 1, "dropped": 0}
        await pub0.publish(1, stored_batch(400, 4, rank=5))  # a rank this pod has no endpoint for
        await wait_for(lambda: m.stats.messages == 4)
        assert held(m, 400) == {RANK0: 0, RANK1: 0} and m.stats.other_rank == {"attributed": 1, "dropped": 1}
        assert m.usable_among([RANK0, RANK1], m.now()) == {RANK0, RANK1}
        # Rank 0's publisher starts over: what it said for rank 1 goes with its own entries.
        await pub0.publish(0, stored_batch(500, 4, rank=0))
        await wait_for(lambda: m.stats.restarts == 1 and m.stats.messages == 5)
        assert held(m, 300) == {RANK0: 0, RANK1: 0} and held(m, 500) == {RANK0: 4, RANK1: 0}
        assert held(m, 100) == held(m, 200) == {RANK0: 0, RANK1: 4}  # rank 1's own publisher's, kept
