"""Build the default scheduling profile from EppConfig.

Default profile: filter hot-spot-spill-filter; scorers prefix-cache-scorer (weight 3) and
inflight-load-scorer (weight 2); picker max-score-picker with --max-endpoints results.
"""

from __future__ import annotations

import random

from extproc.config import EppConfig
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.filters.spill import SpillFilter
from extproc.scheduling.picker import MaxScorePicker
from extproc.scheduling.scheduler import Scheduler, WeightedScorer
from extproc.scheduling.scorers.inflight import InflightLoadScorer
from extproc.scheduling.scorers.prefix import PrefixScorer


def default_scheduler(config: EppConfig, index: PrefixIndex) -> Scheduler:
    rng = random.Random(config.seed)
    return Scheduler(
        filters=[SpillFilter(config.spill.relative, config.spill.absolute)],
        scorers=[
            WeightedScorer(PrefixScorer(), config.weights.prefix),
            WeightedScorer(InflightLoadScorer(), config.weights.inflight),
        ],
        picker=MaxScorePicker(rng),
        index=index,
        max_endpoints=config.max_endpoints,
    )
