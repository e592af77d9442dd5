"""The ablation matrix's parts (`python -m bench.ablation`): the mechanisms, their arms and the paired ratio.

`MECHANISMS`: every mechanism of the default path the matrix measures, each with the picker flags
that turn it off (the switch of `--ablate`, extproc/config/settings.py ABLATIONS, or the flag that
already does: `--ttft-calibration=false`, `--eviction-weight 0`, ...) and the workloads where it
claims its gain (its docstring's or docs/ablation.md's evidence). `arms(workload, names)`: the
default (`ON`) and each named mechanism off that claims the workload.

`paired_ratio(offs, ons)`: the arms ran on the same draws (one workload seed per repetition), so
each repetition gives one ratio off / on; the figure is their geometric mean with a 95% interval,
exp(mean(log r) +- t(0.975, n - 1) x sd(log r) / sqrt(n)): a ratio is symmetric in log space (x2
and x0.5 are as far from 1), and the interval holds the repetitions' own spread, machine noise and
draw alike. n = 1 has no interval (NaN). A mechanism pays where its TTFT interval lies above 1
(turned off, TTFT grows) or its hit-rate interval below 1; it costs where the opposite holds;
otherwise its effect is within the spread. (Kept here, not in bench.lib.stats, until the two
paired-ratio helpers are merged.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from extproc.config.settings import ABLATIONS

ON = "default"
# t(0.975, df) for df = 1..30; beyond, the normal's 1.96.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


@dataclass(frozen=True)
class Mechanism:
    name: str
    off: tuple[str, ...]  # picker flags turning it off
    workloads: tuple[str, ...]  # where it claims its gain


BACKLOG = ("shared-prefix", "bursts")
CALIBRATION = ("shared-prefix", "hot-prefix")
SLOTS = ("hot-prefix", "shared-prefix")
CAPACITY = ("cache-pressure", "multi-turn")
SPREAD = ("hot-prefix", "bursts")
_WORKLOADS = {
    "idle-bound": BACKLOG, "waiting-floor": BACKLOG, "finish-drain": BACKLOG, "decode-contention": ("mixed-length",),
    "bytes-per-token": CALIBRATION, "bpt-rescale": CALIBRATION, "calibration-median": CALIBRATION,
    "capacity-window-guard": CAPACITY, "pool-calibration": CALIBRATION, "response-end-calibration": CALIBRATION,
    "first-token-bound": SLOTS, "first-token-twice": SLOTS, "first-token-slot-guard": SLOTS,
    "first-token-capacity-guard": CAPACITY, "first-token-readable": CALIBRATION, "first-token-step-share": SLOTS,
    "first-token-floor": SLOTS, "slot-wait": SLOTS, "slot-ages": SPREAD, "slot-ceiling": SLOTS, "pool-limit": SLOTS,
    "family-memory": CAPACITY, "homes-placement": CAPACITY, "fresh-tail-placement": CAPACITY,
    "bounded-reuse": SPREAD, "new-prompt-bound": SPREAD, "whole-match": ("mixed-length",),
    "kv-usage-fullness": CAPACITY, "capacity-auto-tune": CAPACITY, "pins": CAPACITY,
}
MECHANISMS: dict[str, Mechanism] = {m.name: m for m in (
    *(Mechanism(name, ("--ablate", name), _WORKLOADS[name]) for name in ABLATIONS),
    # Mechanisms a flag already turns off (or, for churn, replaces): the flag, not a switch.
    Mechanism("calibration", ("--ttft-calibration=false",), CALIBRATION),
    Mechanism("eviction-charge", ("--eviction-weight", "0"), CAPACITY),
    Mechanism("balance", ("--balance-factor", "0"), SPREAD),
    Mechanism("affinity-credit", ("--affinity-credit", "0"), ("mixed-shapes",)),
    Mechanism("affinity-hints", ("--affinity-hints=false",), ("mixed-shapes",)),
    Mechanism("churn-placement", ("--new-prefix-placement", "churn"), CAPACITY),
)}


def arms(workload: str, names: Sequence[str]) -> list[str]:
    """The arms run on `workload`: the default first, then each of `names` that claims it."""
    return [ON, *(n for n in names if workload in MECHANISMS[n].workloads)]


def picker_args(arm: str) -> tuple[str, ...]:
    return () if arm == ON else MECHANISMS[arm].off


@dataclass(frozen=True)
class Ratio:
    mean: float  # geometric mean of the paired ratios
    lo: float  # 95% interval; NaN with fewer than 2 pairs
    hi: float
    n: int

    def verdict(self, higher_is_better: bool) -> str:
        """'pays' where turning the mechanism off is worse beyond the interval, 'costs' where it is
        better, '' within the spread (or without an interval)."""
        if math.isnan(self.lo):
            return ""
        worse_off = self.hi < 1 if higher_is_better else self.lo > 1
        better_off = self.lo > 1 if higher_is_better else self.hi < 1
        return "pays" if worse_off else "costs" if better_off else ""


def paired_ratio(offs: Sequence[float], ons: Sequence[float]) -> Ratio:
    """Geometric mean of offs[i] / ons[i] with its 95% t-interval (module docstring); pairs with a
    NaN, a zero or a negative value are left out."""
    logs = [math.log(a / b) for a, b in zip(offs, ons, strict=True)
            if a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b)]
    n = len(logs)
    if n == 0:
        return Ratio(math.nan, math.nan, math.nan, 0)
    mean = sum(logs) / n
    if n < 2:
        return Ratio(math.exp(mean), math.nan, math.nan, n)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = (T975[n - 2] if n - 1 <= len(T975) else 1.96) * sd / math.sqrt(n)
    return Ratio(math.exp(mean), math.exp(mean - half), math.exp(mean + half), n)


def cell(r: Ratio) -> str:
    if math.isnan(r.mean):
        return "-"
    if math.isnan(r.lo):
        return f"{r.mean:.2f}"
    return f"{r.mean:.2f} ({r.lo:.2f}-{r.hi:.2f})"
