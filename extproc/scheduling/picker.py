"""max-score-picker: highest total score first, ties broken at random.

The first n endpoints by total score (descending) are returned (n = --max-endpoints; n > 1
yields an ordered fallback list); among equal totals the order is uniformly random, so equal
endpoints share load instead of the first one taking all. The work per request stays at C speed
whatever the pool: the n-th highest total is found by one sort of the totals, only the endpoints
tied at that total are drawn from (`rng.sample`), and only the n chosen are shuffled and ordered,
so no random number is drawn per candidate (shuffling every candidate first did, one Python-level
call per endpoint: the picker's largest cost at 256 endpoints after the scorers).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from extproc.core.datastore import Endpoint


class MaxScorePicker:
    name = "max-score-picker"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, endpoints: Sequence[Endpoint], totals: Sequence[float], n: int) -> list[Endpoint]:
        n = max(n, 1)
        if not endpoints:
            return []
        total = sum(totals)
        if total != total:  # a NaN total ranks last (the sum is NaN then; rarely otherwise, harmlessly)
            totals = [t if t == t else float("-inf") for t in totals]
        if n == 1:
            best = max(totals)
            tied = [i for i, t in enumerate(totals) if t == best]
            return [endpoints[tied[0] if len(tied) == 1 else self._rng.choice(tied)]]
        if n >= len(endpoints):
            chosen = list(range(len(endpoints)))
        else:
            cut = sorted(totals, reverse=True)[n - 1]
            chosen = [i for i, t in enumerate(totals) if t > cut]
            at_cut = [i for i, t in enumerate(totals) if t == cut]
            chosen += self._rng.sample(at_cut, n - len(chosen))
        self._rng.shuffle(chosen)
        chosen.sort(key=totals.__getitem__, reverse=True)
        return [endpoints[i] for i in chosen]
