"""KV cache tiers in the precise match: each tier's weight, and the walk that weighs a prefix by them.

An engine with vLLM's offloading connector holds blocks on its GPU, in CPU memory and in storage
(`medium` GPU, CPU, STORAGE: extproc/kvevents/wire.py). A block it must load from CPU is far
cheaper than one it must recompute, but not free: the match counts each leading block with the
weight of the best tier that holds it on that engine (`--kv-tier-weights`, EppConfig's
`kv_events.tier_weights`; llm-d's `kvCacheBackendConfigs`): GPU 1.0, CPU 0.8 (llm-d's defaults),
STORAGE 0.3 (llm-d's default for vLLM's storage tier: promotion speed varies widely with the
medium, NVMe to network file systems, so it scores conservatively; raise it on fast storage). A
tier left out keeps its default; weight 0 turns a tier off (its events are not indexed).

`Group`: the slots whose union is one engine's residency, one bit each in the index's holders
masks: an (endpoint, data-parallel rank)'s GPU, CPU and STORAGE slots, or an endpoint's
speculative slot alone (decision-time entries, weighed as GPU: they predict what the engine will
hold there). `walk` answers every candidate group in one pass over the prompt's keys:

    for each key i: held = holders[key i] & union of the groups still running
    a group's run ends at the first key none of its slots holds;
    a key adds the weight of the heaviest tier of its group that holds it.

Consecutive keys usually have the same holders (engines store and evict whole chains), so the
groups are visited only where `held` changes: each unchanged stretch of n keys adds n x that
tier's weight at once. An endpoint's answer is its best group (most weight, then the longer run).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from extproc.kvevents.wire import TIERS


def tier_weights(configured: Sequence[tuple[str, float]], defaults: Sequence[tuple[str, float]]) -> list[float]:
    """Weight per tier (wire.TIERS order): the configured ones over the defaults."""
    by_name = dict(defaults)
    by_name.update(configured)
    return [float(by_name.get(name, 0.0)) for name in TIERS]


@dataclass(slots=True)
class Group:
    endpoint: str
    mask: int = 0  # its slots' bits
    tiers: list[tuple[int, float, int]] = field(default_factory=list)  # (bit mask, weight, tier), heaviest first

    def add(self, bit: int, weight: float, tier: int) -> None:
        self.mask |= 1 << bit
        self.tiers.append((1 << bit, weight, tier))
        self.tiers.sort(key=lambda t: -t[1])


@dataclass(slots=True)
class TierMatch:
    """Per candidate holding a leading block: its run (leading blocks held on any tier), the run
    weighed by tier, and the run's blocks per tier (wire.TIERS order). `weighted` is `runs` itself
    where no lower tier took part (every block weighs 1)."""

    runs: dict[str, int]
    weighted: Mapping[str, float]
    blocks: dict[str, list[int]]  # empty where no lower tier took part (every block on GPU)


def walk(keys: Sequence[int], groups: Sequence[Group], held_of: Callable[[int], int]) -> TierMatch:
    """The module docstring's walk; `held_of(key)`: the bits of every slot holding it."""
    n = len(groups)
    run = [0] * n
    weight = [0.0] * n
    blocks = [[0] * len(TIERS) for _ in range(n)]
    alive = list(range(n))
    union = 0
    for g in groups:
        union |= g.mask
    prev, start, end = -1, 0, len(keys)

    def credit(mask: int, count: int) -> None:
        for gi in alive:
            for bit, w, tier in groups[gi].tiers:
                if mask & bit:
                    weight[gi] += count * w
                    blocks[gi][tier] += count
                    break

    for i, key in enumerate(keys):
        held = held_of(key) & union
        if held == prev:
            continue
        if i:
            credit(prev, i - start)
        still = []
        for gi in alive:
            if groups[gi].mask & held:
                still.append(gi)
            else:
                run[gi] = i
        alive = still
        union = 0
        for gi in alive:
            union |= groups[gi].mask
        prev, start = held & union, i
        if not alive:
            break
    else:
        if end:
            credit(prev, end - start)
        for gi in alive:
            run[gi] = end
    out = TierMatch({}, {}, {})
    weighted: dict[str, float] = {}
    for gi, g in enumerate(groups):
        if not run[gi]:
            continue
        ep = g.endpoint
        best = weighted.get(ep)
        if best is None or weight[gi] > best or (weight[gi] == best and run[gi] > out.runs[ep]):
            weighted[ep] = weight[gi]
            out.runs[ep] = run[gi]
            out.blocks[ep] = blocks[gi]
    out.weighted = weighted
    return out

