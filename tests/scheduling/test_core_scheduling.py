from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from extproc.config.settings import EppConfig, PrefixConfig
from extproc.core.datastore import Datastore, EndpointSpec
from extproc.core.errors import EppError
from extproc.prefix.hashing import block_hashes
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.build import default_scheduler
from extproc.scheduling.filters.spill import SpillFilter
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.picker import MaxScorePicker
from extproc.scheduling.scheduler import Scheduler, WeightedScorer
from extproc.scheduling.scorers.inflight import InflightLoadScorer, min_max_inverse
from extproc.scheduling.scorers.prefix import PrefixScorer

P = PrefixConfig()


def make_ds(n: int) -> Datastore:
    ds = Datastore()
    ds.set_endpoints(EndpointSpec(f"10.0.0.{i}", 8000) for i in range(1, n + 1))
    return ds


def req(prompt: bytes, rid: str = "r") -> SchedulingRequest:
    hashes = block_hashes([prompt], "m", block_size=P.block_size_bytes, max_blocks=P.max_prefix_blocks)
    return SchedulingRequest(request_id=rid, model="m", block_hashes=hashes)


def test_prefix_scorer_ratio() -> None:
    ds = make_ds(3)
    eps = ds.snapshot()
    r = req(b"x" * 640)
    r.prefix_match = {eps[0].key: 10, eps[1].key: 5}
    assert PrefixScorer().score(r, eps) == [1.0, 0.5, 0.0]
    assert PrefixScorer().score(SchedulingRequest("r", "m"), eps) == [0.0, 0.0, 0.0]


def test_inflight_scorer_min_max() -> None:
    assert min_max_inverse([2, 4, 6]) == [1.0, 0.5, 0.0]
    assert min_max_inverse([3, 3]) == [1.0, 1.0]
    ds = make_ds(2)
    ds.acquire(ds.snapshot()[0].key)
    assert InflightLoadScorer().score(req(b"x"), ds.snapshot()) == [0.0, 1.0]


def test_spill_filter_drops_much_busier_endpoints() -> None:
    ds = make_ds(3)
    a, b, c = ds.snapshot()
    for _ in range(10):
        ds.acquire(a.key)
    for _ in range(2):
        ds.acquire(b.key)
    kept = SpillFilter(relative=1.5, absolute=4).filter(req(b"x"), ds.snapshot())
    assert kept == [b, c]  # limit = 1.5*0 + 4: a (10) is skipped
    assert SpillFilter(1.5, 20).filter(req(b"x"), ds.snapshot()) == [a, b, c]
    with pytest.raises(ValueError):
        SpillFilter(0.5, 1)


def test_same_prefix_sticks_and_different_prefixes_spread() -> None:
    ds = make_ds(4)
    sched = default_scheduler(EppConfig(seed=1, scheduler="weighted"), PrefixIndex(10000))
    first = sched.schedule(req(b"shared system prompt " * 40 + b"q0"), ds.snapshot()).primary
    for i in range(1, 10):
        d = sched.schedule(req(b"shared system prompt " * 40 + b"q%d" % i), ds.snapshot())
        assert d.primary is first
        assert d.matched_blocks == d.total_blocks - 1
    counts: Counter[str] = Counter()
    for i in range(200):
        d = sched.schedule(req(random.Random(i).randbytes(800)), ds.snapshot())
        counts[d.primary.key] += 1
    assert len(counts) == 4 and min(counts.values()) > 20


def test_hot_prefix_spills_when_warm_replica_is_busy() -> None:
    """In-flight load builds on the warm replica; past the spill limit a second replica warms up."""
    ds = make_ds(4)
    cfg = EppConfig(seed=2)
    sched = default_scheduler(cfg, PrefixIndex(10000))
    hot = b"hot system prompt " * 50
    chosen: Counter[str] = Counter()
    for i in range(40):
        d = sched.schedule(req(hot + b"%d" % i), ds.snapshot())
        ds.acquire(d.primary.key)  # requests stay in flight
        chosen[d.primary.key] += 1
    loads = sorted(ep.inflight for ep in ds.snapshot())
    assert len(chosen) == 4, chosen
    assert loads[-1] <= cfg.spill.relative * loads[0] + cfg.spill.absolute + 1
    # Once load drops, the prefix is known on every replica that served it.
    for ep in ds.snapshot():
        ep.inflight = 0
    d = sched.schedule(req(hot + b"new"), ds.snapshot())
    assert d.matched_blocks == d.total_blocks - 1


def test_picker_breaks_ties_randomly_and_orders_fallbacks() -> None:
    ds = make_ds(3)
    eps = ds.snapshot()
    picker = MaxScorePicker(random.Random(0))
    firsts = Counter(picker.pick(eps, [1.0, 1.0, 0.5], 1)[0].key for _ in range(200))
    assert set(firsts) == {eps[0].key, eps[1].key}
    assert 60 < firsts[eps[0].key] < 140
    assert picker.pick(eps, [0.1, 0.9, 0.5], 3) == [eps[1], eps[2], eps[0]]


def test_picker_draws_fallbacks_uniformly_among_ties_and_ranks_nan_last() -> None:
    ds = make_ds(6)
    eps = ds.snapshot()
    picker = MaxScorePicker(random.Random(0))
    totals = [0.2, 0.9, 0.5, 0.5, 0.5, float("nan")]
    seconds: Counter[str] = Counter()
    for _ in range(300):
        picked = picker.pick(eps, totals, 2)
        assert picked[0] is eps[1] and picked[1] in (eps[2], eps[3], eps[4])
        seconds[picked[1].key] += 1
    assert all(60 < seconds[eps[i].key] < 140 for i in (2, 3, 4))  # each of the three ~100 times
    assert picker.pick(eps, totals, 6)[-1] is eps[5] and len(picker.pick(eps, totals, 9)) == 6
    assert picker.pick(eps, [float("nan")] * 6, 1)[0] in eps
    assert picker.pick([], [], 1) == []


def test_scheduler_records_decision_and_explains() -> None:
    ds = make_ds(2)
    ix = PrefixIndex(100)
    sched = Scheduler([], [WeightedScorer(PrefixScorer(), 3.0), WeightedScorer(InflightLoadScorer(), 2.0)],
                      MaxScorePicker(random.Random(1)), ix, max_endpoints=2)
    r = req(b"p" * 256)
    d = sched.schedule(r, ds.snapshot())
    assert len(d.endpoints) == 2 and d.destination == ",".join(e.key for e in d.endpoints)
    assert ix.match(r.block_hashes, [d.primary.key]) == {d.primary.key: 4}
    d2 = sched.schedule(req(b"p" * 256), ds.snapshot())
    assert d2.primary is d.primary and d2.matched_blocks == 4
    text = d2.explain()
    assert f"endpoint={d.primary.key}" in text and "matched=4/4" in text
    assert "prefix-cache-scorer=1.000" in text and "total=5.000" in text


def test_empty_filter_result_is_an_error() -> None:
    class Nothing:
        name = "nothing"

        def filter(self, request: SchedulingRequest, endpoints: object) -> list[object]:
            return []

    sched = Scheduler([Nothing()], [], MaxScorePicker(), None, max_endpoints=1)  # type: ignore[list-item]
    with pytest.raises(EppError) as info:
        sched.schedule(req(b"x"), make_ds(1).snapshot())
    assert info.value.http_status == 503


async def test_records_are_made_after_the_answer_and_before_the_next_lookup() -> None:
    """On a running loop a decision returns with its record queued, not made (the answer goes out
    first); the next decision's lookup makes it, so a request right behind it with the same
    prefix still finds it; otherwise the loop's next turn makes it."""
    ds = make_ds(4)
    index = PrefixIndex(10000)
    told: list[str] = []
    index.on_record(lambda endpoint, hashes: told.append(endpoint))
    sched = default_scheduler(EppConfig(seed=1, scheduler="weighted"), index)
    prompt = b"shared system prompt " * 40
    first = sched.schedule(req(prompt + b"q0"), ds.snapshot())
    assert told == []  # queued: nothing inserted or published yet
    second = sched.schedule(req(prompt + b"q1"), ds.snapshot())  # back to back: its lookup flushes
    assert told == [first.primary.key]
    assert second.primary is first.primary and second.matched_blocks == second.total_blocks - 1
    await asyncio.sleep(0)  # the loop's next turn makes the second record
    assert told == [first.primary.key, second.primary.key]
    assert index.held_by(first.primary.key) == len(set(first.block_hashes) | set(second.block_hashes))


def test_without_a_running_loop_the_record_is_made_at_once() -> None:
    ds = make_ds(2)
    index = PrefixIndex(10000)
    told: list[str] = []
    index.on_record(lambda endpoint, hashes: told.append(endpoint))
    d = default_scheduler(EppConfig(seed=1, scheduler="weighted"), index).schedule(req(b"p" * 640), ds.snapshot())
    assert told == [d.primary.key]
