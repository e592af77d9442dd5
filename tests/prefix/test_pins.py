"""Pinned blocks (extproc/prefix/generations.py): a running request's prompt is not evicted from
the index, its end makes it the most recently used, and the pins are bounded."""

from __future__ import annotations

import random

from extproc.config.settings import EppConfig
from extproc.core.datastore import Datastore, EndpointSpec
from extproc.prefix.generations import PIN_BOUND
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.build import default_scheduler
from extproc.scheduling.interfaces import SchedulingRequest


def hashes(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def test_a_running_requests_blocks_outlive_newer_records_until_its_end() -> None:
    ix = PrefixIndex(8)
    running, done, later = hashes(4, 1), hashes(4, 2), hashes(4, 3)
    ix.record_later("a", running, pin=True)
    ix.record("a", done)
    ix.record("a", later)  # 12 blocks on a capacity of 8: the unpinned oldest go
    assert ix.match(running, ["a"]) == {"a": 4}
    assert ix.match(done, ["a"]) == {}
    assert ix.match(later, ["a"]) == {"a": 4}
    assert ix.held_by("a") == 8
    # Unpinned, an LRU ordered by routing alone would have dropped `running` first.
    plain = PrefixIndex(8)
    for h in (running, done, later):
        plain.record("a", h)
    assert plain.match(running, ["a"]) == {} and plain.match(done, ["a"]) == {"a": 4}


def test_the_end_makes_the_blocks_most_recently_used_and_evictable() -> None:
    ix = PrefixIndex(8)
    first, second = hashes(4, 4), hashes(4, 5)
    ix.record_later("a", first, pin=True)
    ix.record_later("a", second, pin=True)
    ix.release("a", second)
    ix.release("a", first)  # ended after `second`: the more recently used
    assert list(ix._lru["a"]) == [*reversed(second), *reversed(first)]  # each prompt's head last
    ix.record("a", hashes(4, 6))
    assert ix.match(first, ["a"]) == {"a": 4}
    assert ix.match(second, ["a"]) == {}
    # Released twice, or a list never pinned: nothing changes.
    ix.release("a", first)
    ix.release("a", hashes(4, 7))
    assert ix.held_by("a") == 8


def test_more_pinned_than_the_capacity_stay_and_the_excess_goes_at_their_end() -> None:
    ix = PrefixIndex(4)
    one, two = hashes(4, 20), hashes(4, 21)
    ix.record("a", one, pin=True)
    ix.record("a", two, pin=True)
    assert ix.held_by("a") == 8 and ix.match(one, ["a"]) == {"a": 4}
    ix.release("a", one)
    assert ix.held_by("a") == 4  # `one` freed and evicted: `two` alone fills the capacity
    assert ix.match(one, ["a"]) == {} and ix.match(two, ["a"]) == {"a": 4}


def test_pins_shared_by_two_requests_hold_until_both_end() -> None:
    ix = PrefixIndex(4)
    prefix = hashes(4, 8)
    one, two = list(prefix), list(prefix)  # two requests with the same prompt
    ix.record_later("a", one, pin=True)
    ix.record_later("a", two, pin=True)
    ix.release("a", one)
    ix.record("a", hashes(4, 9))
    assert ix.match(prefix, ["a"]) == {"a": 4}  # `two` still runs
    ix.release("a", two)
    ix.record("a", hashes(4, 10))  # newer than the freed prefix, in a capacity of 4
    assert ix.match(prefix, ["a"]) == {}


def test_pins_are_bounded_by_the_capacity_and_dropped_with_the_endpoint() -> None:
    capacity = 16
    ix = PrefixIndex(capacity)
    never_ended = [hashes(8, 100 + i) for i in range(20)]  # 160 blocks pinned, ends never reported
    for h in never_ended:
        ix.record_later("a", h, pin=True)
    ix.flush()
    pinned = len(ix._lru["a"].pinned)
    assert PIN_BOUND * capacity <= pinned < PIN_BOUND * capacity + 8
    assert ix.held_by("a") == pinned  # the unpinned requests' blocks were evicted
    assert ix.match(never_ended[-1], ["a"]) == {}
    ix.remove_endpoint("a")
    assert "a" not in ix._pinned and ix.entries == 0


def test_the_scheduler_pins_a_decision_releases_it_at_the_end_and_moves_it_with_a_fallback() -> None:
    ds = Datastore()
    ds.set_endpoints(EndpointSpec(f"10.0.0.{i}", 8000) for i in (1, 2))
    ix = PrefixIndex(8)
    sched = default_scheduler(EppConfig(seed=3, max_endpoints=2, scheduler="weighted"), ix)
    prompt = hashes(6, 11)
    d = sched.schedule(SchedulingRequest("r", "m", block_hashes=prompt), ds.snapshot())
    primary, fallback = d.endpoints
    ix.record(primary.key, hashes(8, 12))  # 14 blocks on a capacity of 8: the running prompt stays
    assert ix.match(prompt, [primary.key]) == {primary.key: 6}
    sched.reassign(d, fallback)  # the fallback served it: its pins move there
    assert primary.key not in ix._pinned and ix.match(prompt, [primary.key]) == {}
    ix.record(fallback.key, hashes(8, 13))
    assert ix.match(prompt, [fallback.key]) == {fallback.key: 6}
    sched.finished(d, fallback)
    assert fallback.key not in ix._pinned
    ix.record(fallback.key, hashes(8, 14))  # unpinned and no longer the newest: evicted
    assert ix.match(prompt, [fallback.key]) == {}
