"""PNG figures of a benchmark run (matplotlib, Agg backend: no display needed).

- `*-ttft.png`: TTFT distribution (empirical CDF, log time axis), one panel per workload, one
  line per router.
- `*-hit_rate.png`: prefix-cache hit rate per workload and router, with the oracle bound.
- `*-ttft_p99.png`: TTFT p99 per workload and router (log axis).
  With repetitions the bars are the means and the error bars span min to max (`bench.lib.aggregate`);
  the TTFT CDF pools every repetition's requests.
- `*-load.png`: requests per replica (sorted, busiest first; the mean by rank over the
  repetitions) per workload and router, with the 2x-mean line of the hot-spot goal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.lib.aggregate import lookup

Summaries = Mapping[str, Mapping[str, Mapping[str, Any]]]  # workload -> router -> summarize() row
Spreads = Mapping[str, Mapping[str, Mapping[str, tuple[float, float]]]]  # workload -> router -> path -> (min, max)


def _panels(n: int, width: float = 5.0, height: float = 3.6) -> tuple[Any, list[Any]]:
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, list(axes[0])


def ttft_cdf(ttfts: Mapping[str, Mapping[str, Sequence[float]]], path: Path) -> None:
    """ttfts[workload][router]: TTFT samples in ms (no figure without samples)."""
    if not ttfts:
        return
    fig, axes = _panels(len(ttfts))
    for ax, (workload, routers) in zip(axes, ttfts.items(), strict=True):
        for router, values in routers.items():
            ordered = sorted(values)
            if ordered:
                ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", label=router)
        ax.set_xscale("log")
        ax.set_title(workload)
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax: Any, summaries: Summaries, spreads: Spreads | None, metric: str, scale: float) -> None:
    """Grouped bars of `metric` (dotted path) per workload and router, min-max error bars from `spreads`."""
    workloads = list(summaries)
    routers = list(dict.fromkeys(r for rows in summaries.values() for r in rows))
    width = 0.8 / max(1, len(routers))
    for j, router in enumerate(routers):
        xs = [i + (j - (len(routers) - 1) / 2) * width for i in range(len(workloads))]
        ys, lo, hi = [], [], []
        for w in workloads:
            row = summaries[w].get(router)
            value = lookup(row, metric) if row is not None else None
            y = 0.0 if value is None or value != value else value  # not run, or NaN: no bar
            low, high = (spreads or {}).get(w, {}).get(router, {}).get(metric, (y, y))
            ys.append(y * scale)
            lo.append(max(0.0, (y - low) * scale))
            hi.append(max(0.0, (high - y) * scale))
        ax.bar(xs, ys, width, label=router, yerr=[lo, hi] if spreads else None, capsize=2)
    ax.set_xticks(range(len(workloads)), workloads, rotation=20, ha="right")


def hit_rates(summaries: Summaries, oracle: Mapping[str, float], path: Path, spreads: Spreads | None = None) -> None:
    workloads = list(summaries)
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(workloads)), 3.8))
    _bars(ax, summaries, spreads, "hit_rate", 100.0)
    for i, w in enumerate(workloads):
        if w in oracle:
            ax.hlines(oracle[w] * 100, i - 0.45, i + 0.45, colors="black", linestyles="dashed",
                      label="oracle" if i == 0 else "_nolegend_")
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.legend(fontsize="small", ncol=3)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ttft_p99(summaries: Summaries, path: Path, spreads: Spreads | None = None) -> None:
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(summaries)), 3.8))
    _bars(ax, summaries, spreads, "ttft_ms.p99", 1.0)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT p99 (ms)")
    ax.legend(fontsize="small", ncol=3)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replica_loads(summaries: Summaries, path: Path) -> None:
    fig, axes = _panels(len(summaries))
    for ax, (workload, rows) in zip(axes, summaries.items(), strict=True):
        routers = list(rows)
        n = max((len(row["requests_per_replica"]) for row in rows.values()), default=1)
        width = 0.8 / n
        mean = 0.0
        for i, router in enumerate(routers):
            counts = sorted(rows[router]["requests_per_replica"].values(), reverse=True)
            mean = max(mean, rows[router]["replica_mean"])
            ax.bar([i + (k - (n - 1) / 2) * width for k in range(len(counts))], counts, width,
                   color=[plt.cm.viridis(k / max(1, n - 1)) for k in range(len(counts))])
        if mean:
            ax.axhline(2 * mean, color="red", linestyle="dashed", label="2x mean")
            ax.legend(fontsize="small")
        ax.set_xticks(range(len(routers)), routers, rotation=30, ha="right", fontsize="small")
        ax.set_title(f"{workload}: requests per replica")
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(summaries: Summaries, oracle: Mapping[str, float],
              ttfts: Mapping[str, Mapping[str, Sequence[float]]], out_dir: Path, prefix: str = "bench",
              spreads: Spreads | None = None) -> list[Path]:
    """Write the figures as {prefix}-ttft.png, -hit_rate.png, -ttft_p99.png, -load.png."""
    paths = [out_dir / f"{prefix}-{kind}.png" for kind in ("ttft", "hit_rate", "ttft_p99", "load")]
    ttft_cdf({w: rows for w, rows in ttfts.items() if w in summaries}, paths[0])
    hit_rates(summaries, oracle, paths[1], spreads)
    ttft_p99(summaries, paths[2], spreads)
    replica_loads(summaries, paths[3])
    return paths
