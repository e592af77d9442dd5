"""A misbehaving engine against the subscriber's bounds (extproc/kvevents/limits.py), with real ZeroMQ
sockets: oversized frames, floods, oversized replays."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import pytest
import zmq
import zmq.asyncio

from extproc.config.settings import KVEventsConfig
from extproc.core.datastore import Datastore, EndpointSpec
from extproc.kvevents.limits import ByteBudget, bounded_socket
from extproc.kvevents.manager import KVEventsManager
from testkit.kvevents import FAST, RawPublisher, stored_batch, wait_for

EP = "127.0.0.1:9"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Picker:
    manager: KVEventsManager
    publisher: RawPublisher
    ctx: zmq.asyncio.Context


@contextlib.asynccontextmanager
async def subscribed_to_raw(config: KVEventsConfig, clock: Clock | None = None,
                            replay: str = "") -> AsyncIterator[Picker]:
    """A running manager subscribed to one RawPublisher (endpoint EP), the subscription arrived."""
    ctx = zmq.asyncio.Context()
    pub = RawPublisher(ctx)
    ds = Datastore()
    m = KVEventsManager(config, ds, clock=clock or time.monotonic)
    task = asyncio.create_task(m.run())
    try:
        await asyncio.sleep(0)
        ds.set_endpoints([EndpointSpec("127.0.0.1", 9, kv_events_endpoint=pub.endpoint + replay)])
        await pub.subscribed()
        yield Picker(m, pub, ctx)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close()
        ctx.destroy(linger=0)


def test_every_socket_is_bounded() -> None:
    ctx = zmq.asyncio.Context()
    try:
        for kind in (zmq.SUB, zmq.DEALER):
            sock = bounded_socket(ctx, kind, KVEventsConfig())
            assert sock.getsockopt(zmq.MAXMSGSIZE) == KVEventsConfig().max_message_bytes == 4 * 1024 * 1024
            assert sock.getsockopt(zmq.RCVHWM) == KVEventsConfig().receive_hwm == 64
            sock.close(linger=0)
    finally:
        ctx.destroy(linger=0)


async def test_a_frame_over_the_limit_disconnects_the_publisher_and_is_never_applied() -> None:
    config = replace(FAST, max_message_bytes=16 * 1024)
    async with subscribed_to_raw(config) as p:
        m, pub = p.manager, p.publisher
        await pub.publish(0, stored_batch(1, 4))
        await wait_for(lambda: m.index.held(EP) == 4)
        huge = stored_batch(1000, 2000)
        assert len(huge) > 5 * config.max_message_bytes
        await pub.publish(1, huge)
        await pub.subscribed()  # libzmq dropped the connection at the frame's header; the SUB reconnected
        await pub.publish(2, stored_batch(5000, 4))
        await wait_for(lambda: m.stats.messages == 2)
        # The oversized batch never reached the index; its loss shows as a gap (no replay: resync).
        assert m.index.held(EP) == 4 and m.stats.gaps == 1 and m.stats.resyncs == {"gap": 1}


async def test_a_flooding_engine_is_rate_limited_and_scored_approximately(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()  # frozen: the budget refills only when the test moves the clock
    config = replace(FAST, max_message_bytes=4096, max_bytes_per_second=10_000, resync_window_s=1.0)
    budget = 2 * config.max_bytes_per_second  # two seconds' worth
    async with subscribed_to_raw(config, clock) as p:
        m, pub = p.manager, p.publisher
        batches = [stored_batch(1 + 100 * i, 16) for i in range(60)]
        sizes = [len(b"kv@test") + 8 + len(b) for b in batches]
        paid = next(i for i in range(len(sizes) + 1) if sum(sizes[:i + 1]) > budget)
        assert 0 < paid < len(batches)
        with caplog.at_level(logging.WARNING, logger="prefix_epp.kvevents"):
            for seq, payload in enumerate(batches):
                await pub.publish(seq, payload)
            await wait_for(lambda: m.stats.messages + m.stats.dropped["rate-limited"] == len(batches))
        assert m.stats.messages == paid and m.stats.dropped["rate-limited"] == len(batches) - paid
        # Entries go (a dropped message may have removed blocks) and precise scoring stops, logged once.
        assert m.index.held(EP) == 0 and not m.usable(EP, clock())
        assert m.stats.resyncs == {"rate-limited": 1} and m.stats.gaps == 0
        assert sum("resync" in r.getMessage() for r in caplog.records) == 1
        # Within its budget again, the engine is applied, and usable once fresh events flowed a window.
        clock.t += 1.0
        await pub.publish(len(batches), stored_batch(9000, 4))
        await wait_for(lambda: m.index.held(EP) == 4)
        clock.t += config.resync_window_s
        assert m.usable(EP, clock())


def test_replays_are_charged_to_the_budget_even_below_zero() -> None:
    budget = ByteBudget(rate=100, burst=200, now=0.0)
    assert budget.take(150, 0.0) and not budget.take(100, 0.0)
    budget.charge(1000, 0.0)  # a replay's bytes: already read, so paid later
    assert not budget.take(1, 5.0)  # 950 in debt, 500 refilled
    assert budget.take(1, 10.0)  # the debt is paid; the bucket never holds more than its burst
    assert budget.take(200, 100.0) and not budget.take(1, 100.0)


async def _serve_replays(router: zmq.asyncio.Socket, messages: int) -> None:
    """A replay ROUTER that answers every request with `messages` batches, then the end marker."""
    while True:
        identity, _, start = await router.recv_multipart()
        first = int.from_bytes(start, "big", signed=True)
        for seq in range(first, first + messages):
            await router.send_multipart([identity, b"", b"kv@test", seq.to_bytes(8, "big"),
                                         stored_batch(100_000 + 10 * seq, 4)])
        await router.send_multipart([identity, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])


async def test_an_oversized_replay_is_abandoned_and_nothing_of_it_applied() -> None:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 0)
    router.bind("tcp://127.0.0.1:*")
    server = asyncio.create_task(_serve_replays(router, 50))
    config = replace(FAST, max_replay_messages=10)
    try:
        async with subscribed_to_raw(config, replay="@" + router.getsockopt_string(zmq.LAST_ENDPOINT)) as p:
            m, pub = p.manager, p.publisher
            await wait_for(lambda: m.stats.replays["oversized"] == 1)  # the replay from 0 after connecting
            await pub.publish(60, stored_batch(1, 4))  # a late join: replayed from 0 again, oversized again
            await wait_for(lambda: m.index.held(EP) == 4)
            assert m.stats.replays == {"recovered": 0, "incomplete": 0, "failed": 0, "oversized": 2}
            assert m.index.held(EP) == 4 and m.stats.late_joins == 1  # only the live batch is indexed
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        router.close(linger=0)
        ctx.destroy(linger=0)
