"""Subscriptions against simulated engines: both encodings, replay, resync, restarts, silence."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import zmq
import zmq.asyncio

from extproc.core.datastore import Datastore, EndpointSpec, ModelServerMetrics
from extproc.kvevents.keys import chain_keys, key_seed
from extproc.kvevents.manager import EXPIRY_EARLY_SHARE, KVEventsManager
from extproc.kvevents.subscriber import Loss
from extproc.tokenization.builtin import encode
from prefix_epp_sim.config import KVEventsEncoding
from prefix_epp_sim.kv_publisher import encode_batch
from prefix_epp_sim.kvcache import BlockRemoved, BlockStored
from prefix_epp_sim.server import Replica
from testkit.kvevents import (
    FAST,
    PROMPTS,
    SIM,
    agrees,
    complete,
    events_stack,
    heard_from,
    post,
    precise_blocks,
    sim_blocks,
    spec_for,
    subscribed,
    wait_for,
)


def drop_once(seq_to_drop: int, dropped: list[int]) -> Loss:
    def loss(endpoint: str, seq: int) -> bool:
        if seq == seq_to_drop and not dropped:
            dropped.append(seq)
            return True
        return False
    return loss


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_index_follows_the_cache_through_evictions_and_reset(encoding: KVEventsEncoding) -> None:
    async with events_stack(sim=replace(SIM, kv_events_encoding=encoding)) as ev:
        rep, m = ev.replicas[0], ev.manager
        for p in [PROMPTS[0], PROMPTS[0], *PROMPTS[1:5]]:
            await complete(rep, p)
        await agrees(m, rep)
        # The scenario really evicted: the oldest prompt is gone, the newest is held, and so says the index.
        assert sim_blocks(rep, PROMPTS[0]) == 0 and precise_blocks(m, rep, PROMPTS[0]) == 0
        assert precise_blocks(m, rep, PROMPTS[4]) == sim_blocks(rep, PROMPTS[4]) >= 10
        assert m.stats.events["BlockRemoved"] > 0 and m.stats.gaps == 0 and ev.usable()
        await post(rep, "/reset_prefix_cache")  # AllBlocksCleared
        await wait_for(lambda: m.stats.events["AllBlocksCleared"] == 1)
        assert m.index.entries == 0 and precise_blocks(m, rep, PROMPTS[4]) == 0 and ev.usable()


async def test_dropped_message_is_recovered_by_replay() -> None:
    dropped: list[int] = []
    async with events_stack(loss=drop_once(1, dropped)) as ev:
        rep, m = ev.replicas[0], ev.manager
        for p in PROMPTS[:4]:
            await complete(rep, p)
        await agrees(m, rep)
        assert dropped == [1] and m.stats.gaps == 1
        assert m.stats.replays["recovered"] == 1 and m.stats.resyncs == {}
        assert precise_blocks(m, rep, PROMPTS[1]) == sim_blocks(rep, PROMPTS[1]) > 0  # what seq 1 carried
        assert ev.usable()


async def test_late_subscriber_recovers_history_by_replay() -> None:
    async with events_stack(subscribe=False) as ev:
        rep, m = ev.replicas[0], ev.manager
        for p in PROMPTS[:3]:
            await complete(rep, p)
        ev.datastore.set_endpoints([spec_for(rep)])
        await agrees(m, rep, PROMPTS[:3])
        assert all(precise_blocks(m, rep, p) > 0 for p in PROMPTS[:3])
        assert m.stats.replays["recovered"] == 1 and m.stats.resyncs == {} and ev.usable()


async def test_late_subscriber_without_replay_is_usable_at_its_first_message() -> None:
    """Joining a running engine is no loss: nothing held can be stale, so no resync window is paid;
    what the engine stored before is missing from the index, and the join is counted."""
    async with events_stack(subscribe=False, replay=False) as ev:
        rep, m = ev.replicas[0], ev.manager
        for p in PROMPTS[:2]:
            await complete(rep, p)
        ev.datastore.set_endpoints([spec_for(rep)])
        assert rep.publisher is not None  # a SUB socket only receives what is published once it subscribed
        await wait_for(lambda: rep.publisher is not None and rep.publisher.subscriptions > 0)
        await complete(rep, PROMPTS[2])
        await wait_for(lambda: precise_blocks(m, rep, PROMPTS[2]) > 0)
        assert precise_blocks(m, rep, PROMPTS[2]) == sim_blocks(rep, PROMPTS[2])
        assert precise_blocks(m, rep, PROMPTS[0]) == 0 < sim_blocks(rep, PROMPTS[0])  # stored before the join
        assert ev.usable() and m.stats.late_joins == 1 and m.stats.resyncs == {} and m.stats.gaps == 0


async def test_a_scraped_restart_drops_the_entries_before_the_new_publisher_speaks() -> None:
    """A restarted engine publishes nothing until it caches again, so its old entries would give stale
    hits; the scrape's process start time says it restarted, and the entries go at once."""
    async with events_stack(replay=False) as ev:
        rep, m = ev.replicas[0], ev.manager
        await complete(rep, PROMPTS[0])
        await wait_for(lambda: precise_blocks(m, rep, PROMPTS[0]) > 0)
        ev.datastore.set_metrics(ev.key(), ModelServerMetrics(ok=True, started_at=1000.0))
        ev.datastore.set_metrics(ev.key(), ModelServerMetrics(ok=True, started_at=1060.0))
        assert precise_blocks(m, rep, PROMPTS[0]) == 0 and m.index.entries == 0 and m.stats.restarts == 1
        await complete(rep, PROMPTS[1])  # the next message starts the new sequence: no gap, no resync
        await wait_for(lambda: precise_blocks(m, rep, PROMPTS[1]) > 0)
        assert m.stats.gaps == 0 and m.stats.resyncs == {} and ev.usable()


async def test_gap_without_replay_drops_entries_and_falls_back_until_fresh_events() -> None:
    dropped: list[int] = []
    async with events_stack(replay=False, loss=drop_once(1, dropped)) as ev:
        rep, m = ev.replicas[0], ev.manager
        keys0 = m.keys_for("sim-model", "", encode(PROMPTS[0]))
        assert keys0 is not None
        await complete(rep, PROMPTS[0])
        await wait_for(lambda: precise_blocks(m, rep, PROMPTS[0]) > 0)
        assert m.match(keys0, [ev.key()])[1] == {ev.key()}
        await complete(rep, PROMPTS[1])  # seq 1: lost, unnoticed until the next message
        await complete(rep, PROMPTS[2])  # seq 2: the gap shows
        await wait_for(lambda: m.stats.resyncs.get("gap") == 1)
        assert dropped == [1]
        assert precise_blocks(m, rep, PROMPTS[0]) == 0 < sim_blocks(rep, PROMPTS[0])  # entries dropped
        assert precise_blocks(m, rep, PROMPTS[2]) == sim_blocks(rep, PROMPTS[2])  # fresh events kept
        assert not ev.usable() and m.match(keys0, [ev.key()])[1] == frozenset()  # approximate fallback
        await wait_for(ev.usable, timeout=3 * FAST.resync_window_s + 1)


async def test_restarted_engine_resets_the_sequence_and_its_entries() -> None:
    ctx = zmq.asyncio.Context()
    ds = Datastore()
    m = KVEventsManager(FAST, ds)
    task = asyncio.create_task(m.run())
    first = Replica(SIM, 0, "127.0.0.1", 0, ctx)
    second: Replica | None = None
    try:
        await first.start()
        await asyncio.sleep(0)
        ds.set_endpoints([spec_for(first, replay=False)])
        await subscribed([first])
        for p in PROMPTS[:2]:
            await complete(first, p)
        await agrees(m, first, PROMPTS[:2])
        assert first.publisher is not None and first.publisher.next_sequence >= 2
        await first.stop()
        for _ in range(100):  # ZeroMQ releases the old listener asynchronously
            try:
                second = Replica(replace(SIM, kv_events_endpoint=first.publisher.endpoint), 0, "127.0.0.1",
                                 first.port, ctx)
                await second.start()
                break
            except zmq.ZMQError:
                second = None
                await asyncio.sleep(0.02)
        assert second is not None
        await subscribed([second])  # the SUB socket reconnects on its own
        await complete(second, PROMPTS[2])
        await wait_for(lambda: m.stats.restarts == 1)
        assert precise_blocks(m, second, PROMPTS[0]) == 0  # the old engine's blocks are gone with it
        await wait_for(lambda: precise_blocks(m, second, PROMPTS[2]) == sim_blocks(second, PROMPTS[2]) > 0)
        assert m.usable(f"127.0.0.1:{second.port}", m.now())
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for rep in (first, second):
            if rep is not None:
                await rep.stop()
        ctx.destroy(linger=0)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def test_silent_publisher_ages_out_but_keeps_its_entries() -> None:
    clock = Clock()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)  # tells when the subscription has arrived
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    ds = Datastore()
    m = KVEventsManager(replace(FAST, silence_timeout_s=5.0, speculative_ttl_s=0.0), ds, clock=clock)
    task = asyncio.create_task(m.run())
    tokens = list(range(64))
    keys = chain_keys(tokens, 16, key_seed(None))
    live, dead = "127.0.0.1:9", "127.0.0.1:10"
    try:
        await asyncio.sleep(0)
        ds.set_endpoints([EndpointSpec("127.0.0.1", 9, kv_events_endpoint=endpoint),
                          EndpointSpec("127.0.0.1", 10, kv_events_endpoint="tcp://127.0.0.1:1"),
                          EndpointSpec("127.0.0.1", 11, kv_events_endpoint="not-an-address")])
        assert (await asyncio.wait_for(pub.recv(), 15))[:1] == b"\x01"  # subscribed

        async def publish(seq: int, event: BlockStored | BlockRemoved) -> None:
            await pub.send_multipart([b"kv@test", seq.to_bytes(8, "big"), encode_batch([event], "map", 0.0)])

        await publish(0, BlockStored([1, 2, 3, 4], None, tokens, 16))
        await wait_for(lambda: m.index.held(live) == 4)
        # `dead` never heard from, `bad` cannot even connect: both are scored approximately.
        assert m.match(keys, [live, dead, "127.0.0.1:11"]) == ({live: 4}, frozenset({live}), {live: 4})
        m.record_later(live, keys)  # routed at t=100; the engine should publish soon
        m.flush()
        clock.t = 104.0
        assert m.usable(live, clock())
        clock.t = 106.0
        assert not m.usable(live, clock()) and m.index.held(live) == 4  # silent: aged out, entries kept
        await publish(1, BlockRemoved([99]))  # any message means the publisher is alive
        await wait_for(lambda: m.usable(live, clock()))
        assert m.match(keys, [live])[0] == {live: 4}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close(linger=0)
        ctx.destroy(linger=0)


def test_a_speculative_record_made_later_is_seen_by_the_next_match() -> None:
    """The scheduler's after-the-answer record (`record_later`): queued, then made by the next
    `match` (or `flush`), with the time it was queued; listeners are told when it is made."""
    ds = Datastore()
    ds.set_endpoints([EndpointSpec("10.0.0.1", 8000)])
    now = [100.0]
    m = KVEventsManager(replace(FAST, speculative_ttl_s=2.0), ds, clock=lambda: now[0])
    told: list[str] = []
    m.on_record(lambda endpoint, keys: told.append(endpoint))
    assert m.record_later("10.0.0.1:8000", [5, 6, 7]) is True
    assert m.record_later("10.0.0.1:8000", [5, 6]) is False  # one flush arranged for both
    assert told == [] and m.index.speculative("10.0.0.1:8000") == 0
    now[0] = 101.5
    matched, _, _ = m.match([5, 6, 7], ["10.0.0.1:8000"])
    assert matched == {"10.0.0.1:8000": 3} and told == ["10.0.0.1:8000"] * 2
    now[0] = 102.1  # the TTL counts from when the records were queued (100.0), not made
    assert m.match([5, 6, 7], ["10.0.0.1:8000"])[0] == {}


async def test_speculative_entries_are_dropped_when_due_between_decisions() -> None:
    """A timer drops each record's entries as they come due (a hundredth of the TTL early), no
    lookup needed (a decision's lookup then finds none to drop); a later record keeps its own time."""
    ds = Datastore()
    ds.set_endpoints([EndpointSpec("10.0.0.1", 8000)])
    ttl = 0.1
    m = KVEventsManager(replace(FAST, speculative_ttl_s=ttl), ds)  # run() is not started: no maintenance
    ep = "10.0.0.1:8000"
    m.record_later(ep, [5, 6, 7])
    m.flush()
    first = m.now()
    assert m.index.speculative(ep) == 3 and m.index.next_expiry() == pytest.approx(first + ttl, abs=0.01)
    await wait_for(lambda: m.now() >= first + ttl / 2)
    m.record_later(ep, [8, 9])
    m.flush()
    await wait_for(lambda: m.index.speculative(ep) == 2)  # the first record's three went, by the timer
    assert m.now() >= first + ttl * (1 - EXPIRY_EARLY_SHARE) and m.index.next_expiry() is not None
    await wait_for(lambda: m.index.speculative(ep) == 0 and m.index.next_expiry() is None)


def pool_at_100(n: int) -> tuple[Datastore, list[float], KVEventsManager, list[str]]:
    """n endpoints, a manager on a clock at 100 s (1 s resync window, 5 s silence, no TTL)."""
    ds = Datastore()
    ds.set_endpoints([EndpointSpec(f"10.0.0.{i}", 8000) for i in range(1, n + 1)])
    now = [100.0]
    cfg = replace(FAST, resync_window_s=1.0, silence_timeout_s=5.0, speculative_ttl_s=0.0)
    return ds, now, KVEventsManager(cfg, ds, clock=lambda: now[0]), [f"10.0.0.{i}:8000" for i in range(1, n + 1)]


def test_usable_among_applies_every_rule_to_each_candidate() -> None:
    """One pass over the candidates: every rank heard and in order (an uncertain one once its
    resync window of fresh events passed), not replaying, not silent after being routed to."""
    _, now, m, eps = pool_at_100(7)
    heard_from(m, eps[:6], 90.0)
    m._subs[eps[1]][0].state.heard_at = None  # never heard
    m._subs[eps[2]][0].state.replaying = True
    m._subs[eps[3]][0].state.uncertain_since, m._subs[eps[3]][0].state.fresh_since = 98.0, 99.5  # window not passed
    m._subs[eps[4]][0].state.uncertain_since, m._subs[eps[4]][0].state.fresh_since = 97.0, 98.5  # passed: usable again
    m._awaiting[eps[5]] = 94.0  # routed to 6 s ago, nothing heard since: silent
    # eps[6]: no subscriber at all
    assert m.usable_among(eps, now[0]) == frozenset({eps[0], eps[4]})
    assert [m.usable(ep, now[0]) for ep in eps] == [True, False, False, False, True, False, False]
    m._heard(eps[5])  # a message after the silence: usable again
    assert m.usable_among(eps, now[0]) == frozenset({eps[0], eps[4], eps[5]})


def test_usable_among_keeps_its_answer_until_a_state_an_endpoint_or_the_time_changes_it() -> None:
    """The pool's answer is kept between decisions (the same object comes back) and redone when
    a source's state changes, an endpoint joins, leaves or speaks after a silence, or the time
    reaches an uncertain source's end of window or a routed endpoint's end of silence."""
    ds, now, m, eps = pool_at_100(5)
    heard_from(m, eps[:4], 90.0)
    first = m.usable_among(eps, now[0])
    assert first == frozenset(eps[:4]) and m.usable_among(list(eps), now[0]) is first
    state = m._subs[eps[0]][0].state
    state.uncertain_since = 100.0  # a resync
    assert m.usable_among(eps, now[0]) == frozenset(eps[1:4])
    state.fresh_since = 100.5  # fresh events since: usable once the 1 s window has passed
    now[0] = 101.4
    kept = m.usable_among(eps, now[0])
    assert kept == frozenset(eps[1:4]) and m.usable_among(eps, now[0]) is kept
    now[0] = 101.5
    assert m.usable_among(eps, now[0]) == frozenset(eps[:4])
    m.record_later(eps[1], [1, 2])  # routed at 101.5: silent after 106.5 unless a message comes
    m.flush()
    now[0] = 106.5
    assert m.usable_among(eps, now[0]) == frozenset(eps[:4])
    now[0] = 106.6
    assert m.usable_among(eps, now[0]) == frozenset({eps[0], eps[2], eps[3]})
    m._heard(eps[1])
    assert m.usable_among(eps, now[0]) == frozenset(eps[:4])
    heard_from(m, eps[4:], now[0])  # a subscription that hears its publisher
    assert m.usable_among(eps, now[0]) == frozenset(eps)
    ds.set_endpoints([EndpointSpec(f"10.0.0.{i}", 8000) for i in range(2, 6)])  # 10.0.0.1 leaves
    assert m.usable_among(eps, now[0]) == frozenset(eps[1:])
