"""Bounded reuse (extproc/scheduling/reuse.py) in predicted-ttft-scorer: a hot prefix spreads over
as many replicas as its load needs, while other prefixes and conversations keep their replicas."""

from __future__ import annotations

from extproc.config.settings import BalanceConfig, EppConfig, LatencyConfig, PrefixConfig
from extproc.core.datastore import Datastore, Endpoint, EndpointSpec
from extproc.prefix.hashing import block_hashes
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.build import build_scheduler
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.reuse import MAX_KEYS, ReuseCounts, load_bound, over_bound
from extproc.scheduling.scheduler import Decision, Scheduler
from extproc.scheduling.scorers.predicted_ttft import PredictedTtftScorer
from testkit.scheduling import Clock

LATENCY = LatencyConfig(prefill_ms_per_token=0.1, overhead_ms=10.0, decode_ms_per_seq=0.0, step_tokens=1000,
                        calibrate=False)

HOT = b"H" * 4000  # a 1,000-token system prompt: 100 ms of prefill at the test prior
OTHER = b"O" * 4000


def request(text: bytes, rid: str) -> SchedulingRequest:
    # 4 bytes per token: len(text) / 4 tokens.
    hashes = block_hashes([text], "m", block_size=PrefixConfig().block_size_bytes, max_blocks=4096)
    return SchedulingRequest(request_id=rid, model="m", block_hashes=hashes, prompt_bytes=len(text))


def ttft_scorer(s: Scheduler) -> PredictedTtftScorer:
    scorer = s.scorers[0].scorer
    assert isinstance(scorer, PredictedTtftScorer)
    return scorer


def setup(factor: float = 1.25, slack: float = 1.0, n: int = 4) -> tuple[Datastore, list[Endpoint], Scheduler]:
    ds = Datastore()
    ds.set_endpoints([EndpointSpec(f"10.0.0.{i + 1}", 8000) for i in range(n)])
    cfg = EppConfig(seed=1, latency=LATENCY, balance=BalanceConfig(factor=factor, slack=slack))
    return ds, list(ds.snapshot()), build_scheduler(cfg, PrefixIndex(100_000), clock=Clock())


def place(ds: Datastore, s: Scheduler, eps: list[Endpoint], prompt: bytes, rid: str) -> Decision:
    """Schedule and hold the request in flight, as the transport does; then let a second pass, so
    its prefill is done (the request is decoding) before the next one comes."""
    d = s.schedule(request(prompt, rid), eps)
    ds.acquire(d.primary.key)
    clock = ttft_scorer(s)._clock
    assert isinstance(clock, Clock)
    clock.now += 1.0
    return d


def end(ds: Datastore, s: Scheduler, d: Decision) -> None:
    s.finished(d, d.primary)
    ds.release(d.primary)


def test_the_bound_is_factor_times_the_mean_load_with_the_new_request() -> None:
    assert load_bound(0, 4, 1.25) == 1  # ceil(1.25 x 1 / 4)
    assert load_bound(10, 4, 1.25) == 4  # ceil(1.25 x 11 / 4) = ceil(3.44)
    assert load_bound(15, 4, 1.25) == 5  # exactly 5: no rounding up past it
    assert load_bound(6, 2, 1.5) == 6  # ceil(1.5 x 7 / 2) = ceil(5.25)
    assert load_bound(15, 3.25, 1.25, 0.25) == 2  # a 4x slower one of four: ceil(1.25 x 16 x 0.25 / 3.25)
    # Over: more than `slack` requests reuse the prefix there AND the endpoint is over the bound.
    assert over_bound(2, 4, 4, 1.0)
    assert not over_bound(1, 4, 4, 1.0)  # the prefix is not hot there
    assert not over_bound(5, 3, 4, 1.0)  # the endpoint holds no more than its share


def test_a_hot_prefix_spreads_to_a_second_replica_once_its_requests_reach_the_bound() -> None:
    ds, eps, s = setup()
    first = place(ds, s, eps, HOT + b"q0", "r0")
    home = first.primary
    placed = [place(ds, s, eps, HOT + b"q%d" % i, f"r{i}") for i in range(1, 6)]
    # The first request has no reuse key; two reusing requests fit on the home (slack 1: the
    # prefix is hot there from the third); the third finds 2 reusing and the home at load 3 with
    # ceil(1.25 x 4 / 4) = 2 allowed, so it is priced as a cold placement and goes elsewhere.
    assert [d.primary for d in placed[:2]] == [home, home]
    second = placed[2].primary
    assert second is not home
    assert placed[2].matched_blocks == 0  # the bound priced the home's copy out
    # The new copy is reused in turn: the next hot requests alternate between the two holders
    # rather than opening a third replica.
    assert {d.primary.key for d in placed[3:]} <= {home.key, second.key}
    signals = placed[2].request.signals if placed[2].request is not None else {}
    assert "reuse=over-bound" in signals[home.key]


def test_other_prefixes_keep_their_replica_while_a_hot_prefix_is_bounded_there() -> None:
    ds, eps, s = setup()
    other = place(ds, s, eps, OTHER + b"q0", "o0")
    end(ds, s, other)
    home = other.primary
    # A hot prefix lands on the same replica (its home is chosen among equals by the tie-break:
    # record it there directly) and fills its bound.
    s.index.record(home.key, request(HOT + b"x", "x").block_hashes[:-1])  # type: ignore[union-attr]
    hot = [place(ds, s, eps, HOT + b"q%d" % i, f"h{i}") for i in range(2)]
    assert all(d.primary is home for d in hot)
    # The other prefix has no request in flight: its own reuse count is 0, the bound does not
    # turn it away, and its cached prefix still wins over a cold replica.
    again = place(ds, s, eps, OTHER + b"q1", "o1")
    assert again.primary is home
    assert again.matched_blocks > 0


def test_a_hot_prefix_stays_while_its_endpoint_holds_no_more_than_its_share() -> None:
    """Two endpoints, each with three requests in flight: the hot prefix's home is not over
    ceil(1.25 x 7 / 2) = 5, so its fourth request still reuses it there."""
    ds, eps, s = setup(n=2)
    home = place(ds, s, eps, HOT + b"q0", "r0").primary
    hot = [place(ds, s, eps, HOT + b"q%d" % i, f"r{i}") for i in (1, 2)]
    assert all(d.primary is home for d in hot)
    other = next(ep for ep in eps if ep is not home)
    for _ in range(3):
        ds.acquire(other.key)  # three requests of other prefixes there
    d = place(ds, s, eps, HOT + b"q3", "r3")
    assert d.primary is home and d.matched_blocks > 0


def test_a_finished_request_releases_its_reuse() -> None:
    ds, eps, s = setup()
    first = place(ds, s, eps, HOT + b"q0", "r0")
    home = first.primary
    held = [place(ds, s, eps, HOT + b"q%d" % i, f"r{i}") for i in (1, 2)]
    assert all(d.primary is home for d in held)
    assert len(ttft_scorer(s).reuse) == 1
    for d in held:
        end(ds, s, d)
    assert len(ttft_scorer(s).reuse) == 0
    assert place(ds, s, eps, HOT + b"q3", "r3").primary is home  # credited again


def test_follow_up_turns_of_conversations_are_never_split() -> None:
    """Turn k + 1 reuses turn k's whole prompt: its key is the last block of its own history, so
    many conversations on one replica under one system prompt are not bounded together."""
    ds, eps, s = setup()
    firsts = [place(ds, s, eps, HOT + b"user %02d " % c + bytes([65 + c]) * 400, f"c{c}") for c in range(8)]
    follow = [place(ds, s, eps, HOT + b"user %02d " % c + bytes([65 + c]) * 400 + b" answer; next", f"f{c}")
              for c in range(8)]
    for a, b in zip(firsts, follow, strict=True):
        assert b.primary is a.primary
        assert b.matched_blocks == a.total_blocks - 1  # the whole first turn but its last, partial block


def test_factor_zero_turns_the_bound_off() -> None:
    ds, eps, s = setup(factor=0.0)
    home = place(ds, s, eps, HOT + b"q0", "r0").primary
    assert all(place(ds, s, eps, HOT + b"q%d" % i, f"r{i}").primary is home for i in range(1, 8))
    assert len(ttft_scorer(s).reuse) == 0


def test_the_counts_are_bounded() -> None:
    counts = ReuseCounts()
    assert all(counts.acquire("e", k) for k in range(MAX_KEYS))
    assert not counts.acquire("e", MAX_KEYS)
    assert counts.acquire("e", 0) and counts.get("e", 0) == 2
    counts.release("e", 0)
    counts.release("e", 0)
    assert counts.get("e", 0) == 0 and len(counts) == MAX_KEYS - 1


def test_a_fallback_releases_the_count_on_the_primary() -> None:
    """The served endpoint held nothing of the prompt when the decision was made: the request
    reuses nothing there, so nothing is counted in its place."""
    ds, eps, s = setup(n=2)
    first = place(ds, s, eps, HOT + b"q0", "r0")
    d = place(ds, s, eps, HOT + b"q1", "r1")
    assert d.primary is first.primary
    scorer = ttft_scorer(s)
    assert len(scorer.reuse) == 1
    other = next(ep for ep in eps if ep is not d.primary)
    s.reassign(d, other)
    assert d.request is not None and d.request.reuse is None
    assert len(scorer.reuse) == 0


def test_new_prompts_spread_within_the_load_bound_even_to_slower_endpoints() -> None:
    """A prompt nobody holds has no cache to keep: an endpoint measured a little faster still
    takes no more than the load bound allows (ceil(1.25 x (L + 1) / 3)); without the bound it
    takes every one."""
    for factor, spread in ((1.25, True), (0.0, False)):
        ds, eps, s = setup(factor=factor, n=3)
        scorer = ttft_scorer(s)
        clock = scorer._clock
        assert isinstance(clock, Clock)
        scorer.model.work(eps[0], clock.now).slowdown = 0.8
        placed = [place(ds, s, eps, bytes([65 + i]) * 400, f"n{i}") for i in range(6)]
        owners = {d.primary.key for d in placed}
        assert (len(owners) >= 2) is spread, owners


def test_a_replica_measured_slower_holds_a_smaller_share_of_new_prompts() -> None:
    """One endpoint of four measured 4x slower: the bound is weighted by speed, so the three fast
    ones stay within theirs (ceil(1.25 x (L + 1) x 4/13)) and take every new prompt by cost. An
    equal share (ceil(1.25 x (L + 1) / 4)) would hand the slow one the 16th, a full prefill at 4x,
    once each fast one holds five."""
    ds, eps, s = setup(factor=1.25, n=4)
    scorer = ttft_scorer(s)
    clock = scorer._clock
    assert isinstance(clock, Clock)
    scorer.model.work(eps[3], clock.now).slowdown = 4.0
    placed = [place(ds, s, eps, bytes([65 + i // 26, 65 + i % 26]) * 200, f"n{i}") for i in range(20)]
    counts = {ep.key: sum(1 for d in placed if d.primary is ep) for ep in eps}
    assert counts[eps[3].key] == 0, counts
    assert all(counts[ep.key] >= 6 for ep in eps[:3]), counts
