"""Peer sync between replicas over real gRPC on loopback (extproc/sync/manager.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from extproc.prefix.index import PrefixIndex
from extproc.sync.manager import PeerSync
from testkit.procs import free_ports
from testkit.sync import FAST, SECRET, pool, replica, until


@pytest.fixture
async def pair() -> AsyncIterator[tuple[PeerSync, PeerSync]]:
    pa, pb = free_ports(2)
    a, b = replica(pa, [pa, pb]), replica(pb, [pa, pb])  # each lists itself too
    await a.start()
    await b.start()
    try:
        yield a, b
    finally:
        await a.stop()
        await b.stop()


async def test_decisions_reach_the_peer_and_do_not_echo(pair: tuple[PeerSync, PeerSync]) -> None:
    a, b = pair
    await until(lambda: a.connected_peers() == 1 and b.connected_peers() == 1)
    a.index.record("10.0.0.1:8000", [1, 2, 3])
    b.index.record("10.0.0.2:8000", [1, 9])
    await until(lambda: b.index.match([1, 2, 3], ["10.0.0.1:8000"]) == {"10.0.0.1:8000": 3})
    await until(lambda: a.index.match([1, 9], ["10.0.0.2:8000"]) == {"10.0.0.2:8000": 2})
    # Markers sent after each side applied the other's record: a link delivers in order, so any
    # echo of those records would arrive before the marker that follows it on the same link.
    a.index.record("10.0.0.1:8000", [70])
    b.index.record("10.0.0.2:8000", [71])
    await until(lambda: b.index.match([70], ["10.0.0.1:8000"]) == {"10.0.0.1:8000": 1})
    await until(lambda: a.index.match([71], ["10.0.0.2:8000"]) == {"10.0.0.2:8000": 1})
    assert a.stats.records_applied == 2 and b.stats.records_applied == 2
    assert a.stats.records_sent == 2 and b.stats.records_sent == 2
    assert all(link.is_self for link in a.links.values() if link.address.endswith(str(a.cfg.port)))


async def test_removal_propagates(pair: tuple[PeerSync, PeerSync]) -> None:
    a, b = pair
    await until(lambda: a.connected_peers() == 1)
    a.index.record("10.0.0.1:8000", [1, 2])
    await until(lambda: b.index.held_by("10.0.0.1:8000") == 2)
    a.outbox.removed("10.0.0.1:8000")
    await until(lambda: b.index.held_by("10.0.0.1:8000") == 0)


async def test_non_peer_cannot_inject() -> None:
    pa, pm = free_ports(2)
    a = replica(pa, [])
    mallory = replica(pm, [pa], secret=b"m" * 32)
    await a.start()
    await mallory.start()
    try:
        await until(lambda: a.stats.rejected["unauthenticated"] >= 2)  # its Hello is refused, again and again
        refused = a.stats.rejected["unauthenticated"]
        mallory.index.record("10.6.6.6:8000", [1, 2, 3])
        mallory.flush()
        await until(lambda: a.stats.rejected["unauthenticated"] > refused)  # it tried again after the flush
        assert a.index.entries == 0 and a.stats.records_applied == 0
        assert mallory.connected_peers() == 0
    finally:
        await mallory.stop()
        await a.stop()


async def test_warm_start_loads_a_peer_snapshot_in_recency_order() -> None:
    pa, pb = free_ports(2)
    a = replica(pa, [], snapshot_chunk_hashes=7)  # many small chunks
    for i in range(20):
        a.index.record(f"10.0.0.{i % 3}:8000", [i * 100 + k for k in range(5)])
    await a.start()
    b = replica(pb, [pa])
    await b.start()
    try:
        loaded = await b.warm_start()
        assert b.warm and loaded == a.index.entries == b.index.entries
        assert dict(b.index.dump()) == dict(a.index.dump())  # same blocks, same LRU order
        assert a.stats.snapshots_served == 1
    finally:
        await b.stop()
        await a.stop()


async def test_warm_start_is_bounded_without_peers() -> None:
    (pb,) = free_ports(1)
    (dead,) = free_ports(1)
    b = replica(pb, [dead], warm_timeout_s=0.5)
    await b.start()
    try:
        started = asyncio.get_running_loop().time()
        assert await b.warm_start() == 0
        assert b.warm and asyncio.get_running_loop().time() - started < 3.0
    finally:
        await b.stop()


async def test_unreachable_peer_costs_bounded_memory_and_counts_drops() -> None:
    (pa,) = free_ports(1)
    (dead,) = free_ports(1)
    a = replica(pa, [dead], peer_queue_frames=2, pending_limit=5)
    await a.start()
    try:
        for i in range(8):
            a.index.record("10.0.0.1:8000", [i])
        assert a.stats.dropped["outbox_full"] == 3  # the request path never waits
        for _ in range(4):
            a.index.record("10.0.0.1:8000", [99])
            a.flush()
        assert a.stats.dropped["peer_queue_full"] >= 2
        assert next(iter(a.links.values())).pending <= 2
    finally:
        await a.stop()


async def test_scale_down_and_up_follow_set_peers(pair: tuple[PeerSync, PeerSync]) -> None:
    a, b = pair
    (pc,) = free_ports(1)
    c = replica(pc, [])
    await c.start()
    try:
        a.set_peers([f"127.0.0.1:{c.cfg.port}"])
        assert list(a.links) == [f"127.0.0.1:{c.cfg.port}"]
        await until(lambda: a.connected_peers() == 1)
        a.index.record("10.0.0.1:8000", [5])
        await until(lambda: c.index.held_by("10.0.0.1:8000") == 1)
        assert b.index.held_by("10.0.0.1:8000") == 0  # b is no longer a peer of a: no link to send on
    finally:
        await c.stop()


async def test_precise_speculative_entries_are_shared() -> None:
    from extproc.config.settings import KVEventsConfig
    from extproc.kvevents.manager import KVEventsManager

    pa, pb = free_ports(2)
    managers = [KVEventsManager(KVEventsConfig(speculative_ttl_s=60), pool()) for _ in range(2)]
    syncs = []
    for port, peer, manager in ((pa, pb, managers[0]), (pb, pa, managers[1])):
        cfg = replace(FAST, port=port, peers=(f"127.0.0.1:{peer}",))
        sync = PeerSync(cfg, SECRET, PrefixIndex(100), manager, datastore=manager.datastore, bind="127.0.0.1")
        manager.on_record(sync.outbox.speculative)
        await sync.start()
        syncs.append(sync)
    try:
        managers[0].record_later("10.0.0.1:8000", [11, 12, 13])
        managers[0].flush()
        await until(lambda: managers[1].index.speculative("10.0.0.1:8000") == 3)
        assert managers[1].index.match([11, 12, 13], ["10.0.0.1:8000"], managers[1].now()) == {"10.0.0.1:8000": 3}
        managers[1].record_later("10.0.0.2:8000", [99])  # a marker behind any echo on the same link
        managers[1].flush()
        await until(lambda: managers[0].index.speculative("10.0.0.2:8000") == 1)
        assert managers[0].index.speculative("10.0.0.1:8000") == 3  # applied once, no echo growth
        assert syncs[0].stats.records_applied == 1  # the marker; nothing of its own came back
    finally:
        for sync in syncs:
            await sync.stop()


def test_outbox_cuts_frames_by_records_and_hashes() -> None:
    from extproc.sync.outbox import Outbox, SyncStats

    box = Outbox(100, SyncStats())
    for i in range(5):
        box.record(f"e{i}:1", list(range(10)))
    assert [ep for _, ep, _ in box.take(3, 1000)] == ["e0:1", "e1:1", "e2:1"]
    assert [ep for _, ep, _ in box.take(10, 15)] == ["e3:1"]  # a second record would pass 15 hashes
    box.record("big:1", list(range(50)))
    assert len(box.take(10, 15)) == 1 and len(box.take(10, 15)) == 1  # an oversized record still goes alone
    assert len(box) == 0
