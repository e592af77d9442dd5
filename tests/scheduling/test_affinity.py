"""Affinity hints in the scheduler: lookup, record, reassign, scoring and the explanation."""

from __future__ import annotations

import random
from collections import Counter

import orjson

from extproc.config.settings import AffinityConfig, EppConfig, PrefixConfig
from extproc.control.director import RequestContext
from extproc.core.datastore import Datastore, EndpointSpec
from extproc.prefix.hashing import affinity_hash, block_hashes
from extproc.prefix.index import PrefixIndex
from extproc.runtime.app import App
from extproc.scheduling.build import default_scheduler
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.scorers.prefix import PrefixScorer

P = PrefixConfig()


def make_ds(n: int) -> Datastore:
    ds = Datastore()
    ds.set_endpoints(EndpointSpec(f"10.0.0.{i}", 8000) for i in range(1, n + 1))
    return ds


def req(prompt: bytes, key: str | None = None) -> SchedulingRequest:
    hashes = block_hashes([prompt], "m", block_size=P.block_size_bytes, max_blocks=P.max_prefix_blocks)
    return SchedulingRequest(request_id="r", model="m", block_hashes=hashes,
                             affinity_hash=None if key is None else affinity_hash("m", "", key))


def test_prefix_scorer_counts_the_key_as_one_more_leading_block() -> None:
    eps = make_ds(3).snapshot()
    a, b, c = (ep.key for ep in eps)
    r = req(b"x" * 256, "k")  # 4 blocks
    r.prefix_match = {a: 4, b: 2}
    r.affinity_match = frozenset({a, c})
    assert PrefixScorer().score(r, eps) == [1.0, 2 / 5, 1 / 5]
    r.affinity_match = frozenset()
    assert PrefixScorer().score(r, eps) == [4 / 5, 2 / 5, 0.0]
    no_hint = req(b"x" * 256)
    no_hint.prefix_match = {a: 4, b: 2}
    assert PrefixScorer().score(no_hint, eps) == [1.0, 0.5, 0.0]  # unchanged without a hint
    empty = SchedulingRequest("r", "m", affinity_hash=1, affinity_match=frozenset({b}))
    assert PrefixScorer().score(empty, eps) == [0.0, 1.0, 0.0]


def test_same_key_different_prompts_land_together_when_loads_are_equal() -> None:
    ds = make_ds(4)
    sched = default_scheduler(EppConfig(seed=5, scheduler="weighted"), PrefixIndex(10000))
    rng = random.Random(1)
    places: Counter[str] = Counter()
    for k in range(40):
        first = sched.schedule(req(rng.randbytes(600), f"user-{k}"), ds.snapshot())
        assert first.affinity_hit is False and first.matched_blocks == 0
        second = sched.schedule(req(rng.randbytes(600), f"user-{k}"), ds.snapshot())
        assert second.matched_blocks == 0  # nothing of the prompt is shared ...
        assert second.affinity_hit is True and second.primary is first.primary  # ... the key is
        places[first.primary.key] += 1
    assert len(places) == 4  # the keys themselves still spread over the pool
    # Without keys the same pairs are scattered at random.
    together = sum(sched.schedule(req(rng.randbytes(600)), ds.snapshot()).primary
                   is sched.schedule(req(rng.randbytes(600)), ds.snapshot()).primary for _ in range(40))
    assert together < 25


def test_other_keys_still_match_the_same_prompt_blocks() -> None:
    ds = make_ds(4)
    ix = PrefixIndex(10000)
    sched = default_scheduler(EppConfig(seed=2, scheduler="weighted"), ix)
    prompt = b"a long shared system prompt " * 40
    first = sched.schedule(req(prompt, "alice"), ds.snapshot())
    second = sched.schedule(req(prompt, "bob"), ds.snapshot())
    assert second.affinity_hit is False
    assert second.primary is first.primary and second.matched_blocks == second.total_blocks
    # The keys are their own one-block chains, recorded beside (not before) the prompt's blocks.
    assert ix.match(req(prompt).block_hashes, [first.primary.key]) == {first.primary.key: second.total_blocks}
    for who in ("alice", "bob"):
        assert ix.match([affinity_hash("m", "", who)], [first.primary.key]) == {first.primary.key: 1}


def test_reassign_moves_the_key_to_the_endpoint_that_served() -> None:
    ds = make_ds(3)
    ix = PrefixIndex(10000)
    sched = default_scheduler(EppConfig(seed=4, max_endpoints=2, scheduler="weighted"), ix)
    h = affinity_hash("m", "", "conv-1")
    d = sched.schedule(req(b"p" * 300, "conv-1"), ds.snapshot())
    primary, fallback = d.endpoints
    sched.reassign(d, fallback)
    assert ix.match([h], [primary.key, fallback.key]) == {fallback.key: 1}
    # A primary that had recorded the key before keeps it: it still holds that conversation.
    ix.record(primary.key, [h])
    d2 = sched.schedule(req(b"q" * 300, "conv-1"), ds.snapshot())
    assert d2.affinity_hit is True
    other = d2.endpoints[1]
    sched.reassign(d2, other)
    assert ix.match([h], [d2.primary.key])[d2.primary.key] == 1 and ix.match([h], [other.key]) == {other.key: 1}


def test_explain_reports_hit_or_miss_never_the_key() -> None:
    ds = make_ds(2)
    sched = default_scheduler(EppConfig(seed=1, scheduler="weighted"), PrefixIndex(10000))
    assert "affinity" not in sched.schedule(req(b"z" * 100), ds.snapshot()).explain()
    miss = sched.schedule(req(b"z" * 100, "secret-key"), ds.snapshot()).explain()
    hit = sched.schedule(req(b"y" * 100, "secret-key"), ds.snapshot()).explain()
    assert "affinity=miss" in miss and "affinity=hit" in hit
    assert "secret-key" not in miss + hit


def route(enabled: bool, cache_key: str, session: str) -> tuple[App, RequestContext, bool | None]:
    app = App(EppConfig(seed=1, affinity=AffinityConfig(enabled=enabled)))
    app.datastore.set_endpoints([EndpointSpec("10.0.0.1", 8000), EndpointSpec("10.0.0.2", 8000)])
    ctx = RequestContext(path="/v1/completions", session=session)
    body = orjson.dumps({"model": "m", "prompt": "hello " * 30, "prompt_cache_key": cache_key})
    return app, ctx, app.director.route(ctx, body).affinity_hit


def test_director_takes_the_key_from_the_body_first_then_the_header() -> None:
    _, ctx, hit = route(True, "conv-9", "s-1")
    assert (ctx.affinity_source, hit) == ("prompt_cache_key", False)
    _, ctx, hit = route(True, "", "s-1")
    assert (ctx.affinity_source, hit) == ("session_header", False)
    _, ctx, hit = route(True, "", "")
    assert (ctx.affinity_source, hit) == ("", None)


def test_off_switch_ignores_both_sources() -> None:
    for cache_key, session in (("conv-9", ""), ("", "s-1"), ("conv-9", "s-1")):
        app, ctx, hit = route(False, cache_key, session)
        assert (ctx.affinity_source, hit) == ("", None)
        keys = [affinity_hash("m", "", k) for k in ("conv-9", "s-1")]
        assert app.index.match(keys[:1], app.index.endpoints()) == {}
        assert app.index.match(keys[1:], app.index.endpoints()) == {}
