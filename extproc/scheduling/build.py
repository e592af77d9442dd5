"""Build the scheduler from EppConfig and, optionally, a Profile from an EndpointPickerConfig.

Built-in profiles (no --config-file / --config-text), chosen by --scheduler (EppConfig.scheduler):

predicted-ttft (the default):

    scorers:  predicted-ttft-scorer          weight 1  (extproc/scheduling/scorers/predicted_ttft.py)
    picker:   max-score-picker               --max-endpoints results (default 1)

i.e. the endpoint with the least predicted time to first token, which weighs cache affinity,
token-aware load and cache capacity in one unit (milliseconds) instead of adding scores of
incomparable quantities; a prefix hot on an endpoint above its share of the load is not credited
there (bounded reuse, extproc/scheduling/reuse.py), so it spreads instead of piling up. It is the
default by measurement (`python -m bench.run --quick --repeat 3`, bench/results/bench-quick.md,
means of 3 runs, before bounded reuse): TTFT p99 below the weighted profile's on six of
seven workloads, most where request counts mislead (mixed-length 1,862 vs 2,943 ms; hot-prefix 636
vs 763), with an equal or higher hit rate everywhere; under cache pressure the two are level
(p99 2,896 vs 2,783 ms, hit rate 31.9 % vs 29.1 %).

weighted (the Go EPP's weighted sum, our default before predicted TTFT):

    filters:  hot-spot-spill-filter          (relative 1.5, absolute 4; --spill-relative/--spill-absolute)
    scorers:  prefix-cache-scorer            weight 5  (--prefix-weight)
              queue-scorer                   weight 2
              kv-cache-utilization-scorer    weight 2
              inflight-load-scorer           weight 1  (--inflight-weight)
    picker:   max-score-picker               --max-endpoints results (default 1)

The Go EPP's default is prefix 3, queue 2, kv-cache 2 with no filter. The spill filter and the
in-flight scorer are ours: they keep load signals alive between scrapes and when an engine
exports no metrics (its queue and KV scorers are then 0 for every endpoint, i.e. neutral).
The prefix weight is 5, not 3, because queue-scorer and inflight-load-scorer are both min-max
normalised: any load difference, even one request, spreads them over their full weight, so
with prefix 3 the two (2 + 2) outvote a full cache hit and hot prefixes thrash between replicas.
With 5 > 2 + 2 a full hit wins until the spill filter or the KV scorer intervenes. Measured in a
discrete-event simulation of 4 engines (4 slots, 80 ms hit / 400 ms miss, LRU of 6 prefixes,
scrapes every 50 ms, 2-3 seeds): 3/2/2/2 had a 78-85 % hit rate and 4x the p95 latency of Go's
3/2/2 (99 %) at light load and collapsed at high load (46 % hits); 5/2/2/2 matched Go's 3/2/2
within 1-2 % on hit rate and latency up to moderate load (at overload, Go's 3/2/2 without the
spill filter kept lower latency). The in-flight weight is 1, not 2: measured with `make bench`
(4 simulated replicas), weight 2 moved 31 % of multi-turn follow-up turns off their replica
whenever it was the busiest (87 % of the oracle hit rate, TTFT p50 129 ms); weight 1 moved 17 %
(93 % of the oracle, TTFT p50 75 ms) with no loss on shared-prefix and a flatter hot-prefix load
(max/mean 1.13 instead of 1.25). Weights live in EppConfig.weights; the saturation detector
(utilization-detector) is the director's admission hook (extproc/runtime/app.py), not a profile plugin.

cache-aware (sglang-router's cache_aware policy, the reference the others are compared with):

    scorers:  cache-aware-scorer             weight 1  (extproc/scheduling/scorers/cache_aware.py)
    picker:   max-score-picker               --max-endpoints results (default 1)

i.e. the least loaded endpoint (by the picker's own in-flight counts) while loads are imbalanced,
else the longest prefix match if it covers more than --cache-threshold of the prompt, else the
least loaded.

Prefill/decode disaggregation (an EndpointPickerConfig with disagg-profile-handler): the decode
profile is the Profile, its `prefill` the prefill profile and `decider` the decider's type; the
prefill profile gets its own scheduler (extproc/scheduling/disagg.py).

Registries map each plugin type to a factory: FILTERS, SCORERS, PICKERS. The config loader
(extproc/scheduling/config_loader.py) validates profiles against them.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from extproc.config.settings import SCHEDULERS, EppConfig
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.deciders import ALWAYS, DECIDERS, PREFIX_BASED, AlwaysDecider, Decider, PrefixBasedDecider
from extproc.scheduling.disagg import PrefillStage
from extproc.scheduling.filters.roles import decode_filter, prefill_filter
from extproc.scheduling.filters.spill import SpillFilter
from extproc.scheduling.interfaces import Filter, Picker, PreciseSource, Scorer
from extproc.scheduling.picker import MaxScorePicker
from extproc.scheduling.saturation import UtilizationDetector
from extproc.scheduling.scheduler import Scheduler, WeightedScorer
from extproc.scheduling.scorers.cache_aware import CacheAwareScorer
from extproc.scheduling.scorers.inflight import InflightLoadScorer
from extproc.scheduling.scorers.kv_cache import KvCacheScorer
from extproc.scheduling.scorers.lora import LoraAffinityScorer
from extproc.scheduling.scorers.precise_prefix import PrecisePrefixScorer
from extproc.scheduling.scorers.predicted_ttft import PredictedTtftScorer
from extproc.scheduling.scorers.prefix import PrefixScorer
from extproc.scheduling.scorers.queue import QueueScorer
from extproc.scheduling.shortlist import Shortlist

Clock = Callable[[], float]


@dataclass(frozen=True)
class Profile:
    """One scheduling profile: plugin types in order, scorer weights, the picker type; with
    prefill/decode disaggregation this is the decode profile, and `prefill` the prefill one."""

    name: str
    filters: tuple[str, ...]
    scorers: tuple[tuple[str, float], ...]
    picker: str = "max-score-picker"
    prefill: Profile | None = None  # P/D: the prefill profile (extproc/scheduling/disagg.py)
    decider: str = ""  # P/D: the prefill decider's type (extproc/scheduling/deciders.py)

    def scorer_types(self) -> list[str]:
        """Every scorer type that runs, the prefill profile's included."""
        return [t for t, _ in self.scorers] + (self.prefill.scorer_types() if self.prefill is not None else [])


FILTERS: dict[str, Callable[[EppConfig, Clock], Filter]] = {
    "hot-spot-spill-filter": lambda c, _clock: SpillFilter(c.spill.relative, c.spill.absolute),
    "utilization-detector": lambda c, clock: UtilizationDetector(c.saturation, clock),
    "prefill-filter": lambda _c, _clock: prefill_filter(),
    "decode-filter": lambda _c, _clock: decode_filter(),
}
SCORERS: dict[str, Callable[[EppConfig, Clock], Scorer]] = {
    "prefix-cache-scorer": lambda _c, _clock: PrefixScorer(),
    "precise-prefix-cache-scorer": lambda _c, _clock: PrecisePrefixScorer(),
    "queue-scorer": lambda c, clock: QueueScorer(c.metrics_staleness_threshold_s, clock),
    "kv-cache-utilization-scorer": lambda c, clock: KvCacheScorer(c.metrics_staleness_threshold_s, clock),
    "lora-affinity-scorer": lambda c, clock: LoraAffinityScorer(c.metrics_staleness_threshold_s, clock),
    "inflight-load-scorer": lambda _c, _clock: InflightLoadScorer(),
    "predicted-ttft-scorer": lambda c, clock: PredictedTtftScorer(c, clock),
    "cache-aware-scorer": lambda c, _clock: CacheAwareScorer(c.cache_aware),
}
PICKERS: dict[str, Callable[[EppConfig, Clock], Picker]] = {
    "max-score-picker": lambda c, _clock: MaxScorePicker(random.Random(c.seed)),
}


def default_profile(config: EppConfig) -> Profile:
    """The built-in profile `--scheduler` names (EppConfig.scheduler)."""
    if config.scheduler == "predicted-ttft":
        return Profile(name="default", filters=(), scorers=(("predicted-ttft-scorer", 1.0),))
    if config.scheduler == "cache-aware":
        return Profile(name="default", filters=(), scorers=(("cache-aware-scorer", 1.0),))
    if config.scheduler != "weighted":
        raise ValueError(f"unknown scheduler {config.scheduler!r}; choose from {', '.join(SCHEDULERS)}")
    w = config.weights
    # --prefix-scorer precise: precise-prefix-cache-scorer takes prefix-cache-scorer's place and weight.
    prefix = "precise-prefix-cache-scorer" if config.kv_events.prefix_scorer == "precise" else "prefix-cache-scorer"
    return Profile(
        name="default",
        filters=("hot-spot-spill-filter",),
        scorers=((prefix, w.prefix), ("queue-scorer", w.queue),
                 ("kv-cache-utilization-scorer", w.kv_cache), ("inflight-load-scorer", w.inflight)),
    )


def build_scheduler(config: EppConfig, index: PrefixIndex, profile: Profile | None = None,
                    clock: Clock = time.monotonic, precise: PreciseSource | None = None,
                    max_endpoints: int | None = None) -> Scheduler:
    """The profile's scheduler (the default profile's without one); with a prefill profile, its own
    scheduler (one endpoint) and the decider run after each pick (extproc/scheduling/disagg.py)."""
    p = profile or default_profile(config)
    scorers = [WeightedScorer(SCORERS[t](config, clock), w) for t, w in p.scorers]
    for ws in scorers:
        if isinstance(ws.scorer, PredictedTtftScorer):
            ws.scorer.bind_index(index)  # fullness of each endpoint's cache
    scheduler = Scheduler(
        filters=[FILTERS[t](config, clock) for t in p.filters],
        scorers=scorers,
        picker=PICKERS[p.picker](config, clock),
        index=index,
        max_endpoints=config.max_endpoints if max_endpoints is None else max_endpoints,
        precise=precise,
        shortlist=Shortlist(config.max_scored_endpoints, random.Random(config.seed)),
        pin="pins" not in config.latency.ablate,
    )
    if p.prefill is not None:
        prefill = build_scheduler(config, index, p.prefill, clock, precise, max_endpoints=1)
        scheduler.prefill = PrefillStage(prefill, make_decider(config, p.decider))
    return scheduler


def make_decider(config: EppConfig, decider: str) -> Decider:
    block, per_token = config.prefix.block_size_bytes, config.prefix.bytes_per_token
    if decider == ALWAYS:
        return AlwaysDecider(block, per_token)
    if decider != PREFIX_BASED:
        raise ValueError(f"unknown P/D decider {decider!r}; choose from {', '.join(DECIDERS)}")
    return PrefixBasedDecider(config.disagg, block, per_token)


def default_scheduler(config: EppConfig, index: PrefixIndex) -> Scheduler:
    return build_scheduler(config, index)
