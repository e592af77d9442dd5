"""precise-prefix-cache-scorer, the scheduler's explicit precise lookup, and configuration."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import replace

import pytest

from extproc.config.settings import EppConfig, KVEventsConfig, PrefixConfig
from extproc.config.values import ConfigError
from extproc.core.datastore import Datastore, Endpoint, EndpointSpec
from extproc.discovery.static import parse_endpoints
from extproc.kvevents.ranks import source_addresses
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.build import build_scheduler, default_profile
from extproc.scheduling.config_loader import load_text
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.scorers.precise_prefix import PrecisePrefixScorer

HEAD = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


def endpoints(n: int) -> tuple[Endpoint, ...]:
    ds = Datastore()
    ds.set_endpoints(EndpointSpec(f"10.0.0.{i}", 8000) for i in range(1, n + 1))
    return ds.snapshot()


def test_usable_endpoints_score_precisely_the_others_approximately() -> None:
    a, b, c = endpoints(3)
    r = SchedulingRequest("r", "m", block_hashes=[1, 2, 3, 4], token_keys=[7, 8, 9, 10, 11])
    r.prefix_match = {a.key: 4, b.key: 2, c.key: 4}
    r.precise_match = {a.key: 0, b.key: 5}
    r.precise_weighted = r.precise_match
    r.precise_usable = frozenset({a.key, b.key})
    assert PrecisePrefixScorer().score(r, [a, b, c]) == [0.0, 1.0, 1.0]  # c: no usable events -> approximate
    r.token_keys = None  # no tokens (tokenizer failed, cache_salt): approximate everywhere
    assert PrecisePrefixScorer().score(r, [a, b, c]) == [1.0, 0.5, 1.0]
    # An affinity hint is one more leading block on the endpoints that recorded it.
    r.token_keys = [7, 8, 9, 10, 11]
    r.affinity_hash, r.affinity_match = 99, frozenset({a.key, b.key})
    assert PrecisePrefixScorer().score(r, [a, b, c]) == [1 / 6, 1.0, 4 / 5]


class FakePrecise:
    def __init__(self, usable: set[str], held: dict[str, int]) -> None:
        self.usable, self.held = usable, held
        self.recorded: list[tuple[str, list[int]]] = []

    def match(self, keys: Sequence[int], candidates: Sequence[str]) \
            -> tuple[dict[str, int], frozenset[str], dict[str, int]]:
        held = {k: v for k, v in self.held.items() if k in candidates}
        return held, frozenset(self.usable & set(candidates)), held

    def chosen(self, endpoint: str) -> None:
        pass

    def record_later(self, endpoint: str, keys: Sequence[int]) -> bool:
        self.recorded.append((endpoint, list(keys)))  # made at once: nothing is pending
        return False

    def flush(self) -> None:
        pass


def test_scheduler_fills_the_precise_match_and_records_the_choice() -> None:
    a, b = endpoints(2)
    cfg = replace(EppConfig(seed=1, scheduler="weighted"), kv_events=KVEventsConfig(prefix_scorer="precise"))
    assert default_profile(cfg).scorers[0] == ("precise-prefix-cache-scorer", cfg.weights.prefix)
    index = PrefixIndex(PrefixConfig().lru_capacity_per_server)
    index.record(a.key, [1, 2, 3])  # the approximate index believes a holds the prompt
    precise = FakePrecise(set(), {b.key: 3})  # the engines say b holds it, but no event stream is usable yet
    sched = build_scheduler(cfg, index, precise=precise)
    decision = sched.schedule(SchedulingRequest("r", "m", block_hashes=[1, 2, 3], token_keys=[7, 8, 9]), [a, b])
    assert decision.primary is a and "precise=0/3 (approximate fallback)" in decision.explain()
    precise.usable = {a.key, b.key}
    precise.recorded.clear()
    req = SchedulingRequest("r", "m", block_hashes=[1, 2, 3], token_keys=[7, 8, 9])
    decision = sched.schedule(req, [a, b])
    assert decision.primary is b and req.precise_match == {b.key: 3}
    assert precise.recorded == [(b.key, [7, 8, 9])]
    assert "precise=3/3;" in decision.explain() and decision.precise_usable


class CountingIndex(PrefixIndex):
    """The approximate index, noting which candidates each match was asked for."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.asked: list[list[str]] = []

    def match(self, hashes: Sequence[int], candidates: Iterable[str]) -> dict[str, int]:
        listed = list(candidates)
        self.asked.append(listed)
        return super().match(hashes, listed)


def test_precise_routing_asks_the_approximate_index_only_for_endpoints_without_usable_events() -> None:
    a, b, c = endpoints(3)
    cfg = replace(EppConfig(seed=1), kv_events=KVEventsConfig(prefix_scorer="precise"))
    index = CountingIndex(PrefixConfig().lru_capacity_per_server)
    index.record(a.key, [1, 2, 3])
    index.record(b.key, [1, 2])
    index.record(c.key, [1])
    precise = FakePrecise({a.key, b.key}, {a.key: 3})
    sched = build_scheduler(cfg, index, precise=precise)  # predicted-ttft, precise: approximate as fallback
    req = SchedulingRequest("r", "m", block_hashes=[1, 2, 3], token_keys=[7, 8, 9], prompt_bytes=3 * 64)
    decision = sched.schedule(req, [a, b, c])
    assert index.asked == [[c.key]] and req.prefix_match == {c.key: 1}
    # The chosen endpoint's approximate match is still the decision's (hit ratio, closed loop),
    # read before its record.
    assert decision.primary is a and decision.matched_blocks == 3
    # Every candidate usable: the approximate index is not asked before the pick at all.
    precise.usable = {a.key, b.key, c.key}
    index.asked.clear()
    req = SchedulingRequest("r2", "m", block_hashes=[1, 2, 3, 4], token_keys=[7, 8, 9, 10], prompt_bytes=4 * 64)
    decision = sched.schedule(req, [a, b, c])
    assert index.asked == [] and req.prefix_match == {} and decision.primary is a
    assert decision.matched_blocks == 3  # [1, 2, 3] held, 4 recorded only after this decision
    # A scorer that reads the approximate match everywhere (prefix-cache-scorer) keeps the full lookup.
    weighted = build_scheduler(replace(cfg, scheduler="weighted", kv_events=KVEventsConfig()), index, precise=precise)
    assert weighted.approximate_for_usable
    index.asked.clear()
    weighted.schedule(SchedulingRequest("r3", "m", block_hashes=[1, 2], token_keys=[7, 8]), [a, b, c])
    assert index.asked == [[a.key, b.key, c.key]]


def test_endpoint_picker_config_selects_the_precise_scorer() -> None:
    text = HEAD + (
        "plugins:\n- type: precise-prefix-cache-scorer\n  parameters: {blockSize: 32, speculativeTTL: 500ms,"
        " lruCapacityPerServer: 1000}\n- type: queue-scorer\nschedulingProfiles:\n- name: default\n"
        "  plugins:\n  - pluginRef: precise-prefix-cache-scorer\n    weight: 4\n  - pluginRef: queue-scorer\n")
    cfg, profile = load_text(text, EppConfig())
    assert profile is not None and profile.scorers == (("precise-prefix-cache-scorer", 4.0), ("queue-scorer", 1.0))
    k = cfg.kv_events
    assert (k.block_size, k.speculative_ttl_s, k.index_capacity) == (32, 0.5, 1000)


def test_events_addresses_from_flags_static_syntax_and_ranks() -> None:
    cfg = KVEventsConfig(port=5557, replay_port=5600, dp_size=2)
    plain, explicit, both = parse_endpoints([
        "10.0.0.1:8000,127.0.0.1:8001@tcp://127.0.0.1:6001,[::1]:8002@tcp://[::1]:6002@tcp://[::1]:6100"])
    assert explicit.key == "127.0.0.1:8001" and explicit.kv_events_endpoint == "tcp://127.0.0.1:6001"
    ds = Datastore()
    ds.set_endpoints([plain, explicit, both])
    a, b, c = ds.snapshot()
    assert [(s.events, s.replay) for s in source_addresses(a, cfg)] == [
        ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5600"), ("tcp://10.0.0.1:5558", "tcp://10.0.0.1:5601")]
    assert [s.events for s in source_addresses(b, cfg)] == ["tcp://127.0.0.1:6001", "tcp://127.0.0.1:6002"]
    assert [(s.events, s.replay) for s in source_addresses(c, replace(cfg, dp_size=1))] == [
        ("tcp://[::1]:6002", "tcp://[::1]:6100")]
    assert source_addresses(a, KVEventsConfig())[0].replay is None  # replay off by default


def test_cli_flags_default_to_and_fill_kv_events_config() -> None:
    import argparse

    from extproc.commands import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert serve.config_from_args(parser.parse_args(["--endpoints", "127.0.0.1:1"])).kv_events == KVEventsConfig()
    args = parser.parse_args(["--endpoints", "127.0.0.1:1@tcp://127.0.0.1:2", "--prefix-scorer", "precise",
                              "--kv-events-replay-port", "5558", "--kv-events-speculative-ttl", "250ms",
                              "--kv-events-dp-size", "2", "--tokenizer", "remote", "--tokenizer-timeout", "50ms"])
    k = serve.config_from_args(args).kv_events
    assert (k.prefix_scorer, k.replay_port, k.speculative_ttl_s, k.dp_size, k.tokenizer, k.tokenize_timeout_s) == (
        "precise", 5558, 0.25, 2, "remote", 0.05)


def test_endpoint_picker_config_takes_llm_ds_tier_weights() -> None:
    text = HEAD + ("plugins:\n- type: precise-prefix-cache-scorer\n  parameters:\n    kvCacheBackendConfigs:\n"
                   "    - {name: gpu, weight: 1.0}\n    - {name: CPU, weight: 0.5}\n")
    cfg, _ = load_text(text, EppConfig())
    assert cfg.kv_events.tier_weights == (("gpu", 1.0), ("cpu", 0.5))
    for bad, says in (("[{name: tpu, weight: 1}]", "unknown KV cache tier 'tpu'"),
                      ("[{name: cpu, weight: 1.5}]", "must be in [0, 1]"),
                      ("[{name: cpu}]", "a tier name and a numeric weight"),
                      ("{cpu: 0.8}", "expected a list")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_text(HEAD + f"plugins:\n- type: precise-prefix-cache-scorer\n  parameters:\n"
                             f"    kvCacheBackendConfigs: {bad}\n", EppConfig())
