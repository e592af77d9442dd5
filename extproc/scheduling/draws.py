"""Uniform draws of distinct positions, cheaper than random.sample for a few of a few hundred.

random.sample draws each position in Python (`_randbelow`, a loop of getrandbits calls), about a
microsecond apiece; a decision at a large pool draws a few dozen (extproc/scheduling/shortlist.py's
sample, queue_ranking.py's ties). Here one `getrandbits` call gives a round's 32-bit draws,
unpacked in C and reduced modulo n: a bias below n / 2**32, nothing for load balancing.
"""

from __future__ import annotations

import random
import struct


def draw_into(chosen: set[int], n: int, limit: int, rng: random.Random) -> None:
    """Add positions drawn uniformly from range(n) to `chosen` until it holds `limit` (or all n):
    32-bit draws of one `getrandbits` call per round, reduced modulo n (a bias below n / 2**32),
    where random.sample draws each in Python."""
    limit = min(limit, n)
    while len(chosen) < limit:
        want = limit - len(chosen)
        draws = 2 * want + 2  # duplicates and the already chosen are drawn too
        for v in struct.unpack(f"<{draws}I", rng.getrandbits(32 * draws).to_bytes(4 * draws, "little")):
            chosen.add(v % n)
            if len(chosen) >= limit:
                return
