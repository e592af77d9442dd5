"""max-score-picker: highest total score first, ties broken at random.

The candidates are shuffled, then stably sorted by total score (descending), and the first n are
returned (n = --max-endpoints; n > 1 yields an ordered fallback list). Shuffling first makes
ties random without a second key, so equal endpoints share load instead of the first one taking all.
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
        order = list(range(len(endpoints)))
        self._rng.shuffle(order)
        order.sort(key=totals.__getitem__, reverse=True)
        return [endpoints[i] for i in order[: max(n, 1)]]
