"""bench/results/scale.md and the scale-*.png plots from the combined runs of bench.scale.

Every number is the mean over the repetitions with min-max beside it; the targets of the scale
issue are checked on the means.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

Doc = dict[str, list[dict[str, Any]]]


def _m(row: dict[str, Any], field: str) -> float:
    value = row[field]
    return float(value["mean"]) if isinstance(value, dict) else float(value)


def _fmt(row: dict[str, Any], field: str, digits: int = 2) -> str:
    value = row[field]
    if not isinstance(value, dict):
        return f"{value:.{digits}f}"
    if row.get("reps", 1) == 1:
        return f"{value['mean']:.{digits}f}"
    return f"{value['mean']:.{digits}f} ({value['min']:.{digits}f}-{value['max']:.{digits}f})"


def _find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((r for r in rows if all(r[k] == v for k, v in match.items())), None)


def _reps(rows: list[dict[str, Any]]) -> str:
    reps = sorted({r.get("reps", 1) for r in rows})
    return "/".join(map(str, reps))


def scrape_section(rows: list[dict[str, Any]], out: Path) -> list[str]:
    lines = ["## Scraping (`--part scrape`, bench/scale_scrape.py)", "",
             f"Repetitions: {_reps(rows)}; mean (min-max). `fixed`: every endpoint every 50 ms, whole page "
             "(the design before the scrape plan, here over the narrow HTTP client; it had aiohttp's, dearer per GET: "
             "below). `budgeted`: the defaults, --scrape-budget 500/s for the pool, "
             "only the families read. Model servers: testkit/vllm_stubs.py (vLLM's ~125 KB page) in another process.",
             "", "| endpoints | design | core share | scrapes/s kept | planned | CPU ms/scrape | interval ms | "
             "age mean ms | age p99 ms |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    client = _find(rows, design="client")
    rows = [r for r in rows if r["design"] != "client"]
    for r in rows:
        lines.append(f"| {r['endpoints']} | {r['design']} | {_fmt(r, 'core_share', 3)} | "
                     f"{_fmt(r, 'scrapes_per_s', 0)} | "
                     f"{_fmt(r, 'planned_per_s', 0)} | {_fmt(r, 'cpu_ms_per_scrape', 3)} | "
                     f"{_fmt(r, 'interval_ms', 0)} | {_fmt(r, 'age_mean_ms', 0)} | {_fmt(r, 'age_p99_ms', 0)} |")
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for design in ("fixed", "budgeted"):
        pts = sorted((r["endpoints"], _m(r, "core_share")) for r in rows if r["design"] == design)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=design)
    ax.axhline(0.25, color="grey", linestyle="--", linewidth=1, label="target 0.25")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("endpoints")
    ax.set_ylabel("share of one core, scraping")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "scale-scrape.png", dpi=100)
    plt.close(fig)
    if client is not None:
        lines += ["", "CPU per GET of the filtered page, one after another over kept-alive connections "
                  f"(`client_costs`): aiohttp's client {_fmt(client, 'aiohttp_us_per_get', 0)} us, "
                  f"extproc/scraping/http.py {_fmt(client, 'narrow_us_per_get', 0)} us."]
    return [*lines, "", "![scraper CPU](scale-scrape.png)", ""]


def decision_section(rows: list[dict[str, Any]], out: Path) -> list[str]:
    earlier = [r for r in rows if r.get("code", "current") != "current"
               and r["endpoints"] in (4, 256) and r["tokens"] in (1000, 8000, 128000)]
    rows = [r for r in rows if r.get("code", "current") == "current"]
    lines = ["## Decisions in process (`--part decision`, bench/scale_decide.py)", "",
             f"Repetitions: {_reps(rows)}; mean (min-max) of each repetition's p50, p99 and CPU per request. "
             "Index at capacity (approximate: 31,250 blocks per endpoint; precise: 32,768 per endpoint). "
             "Precise includes tokenization with the shared half of the prompt cached, as far as the first "
             "block no endpoint holds (extproc/kvevents/lookahead.py). p50 and p99: from the body "
             "to the decision; the event loop runs until idle between requests, where what is done after "
             "the answer runs (the index records, extproc/scheduling/scheduler.py; the rest of a prompt "
             "tokenized and recorded), so CPU per request counts it and the latency does not.", "",
             "| mode | endpoints | tokens | body KB | p50 ms | p99 ms | CPU ms/request |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['endpoints']} | {r['tokens']:,} | {_fmt(r, 'body_kb', 0)} | "
                     f"{_fmt(r, 'p50_ms')} | {_fmt(r, 'p99_ms')} | {_fmt(r, 'cpu_ms_per_request')} |")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    panels = ((axes[0], "p99_ms", "decision p99 (ms)"), (axes[1], "cpu_ms_per_request", "CPU per request (ms)"))
    for ax, field, label in panels:
        for mode, style in (("approximate", "-"), ("precise", "--")):
            for tokens in sorted({r["tokens"] for r in rows}):
                pts = sorted((r["endpoints"], _m(r, field)) for r in rows
                             if r["mode"] == mode and r["tokens"] == tokens)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o",
                            label=f"{mode[:6]} {tokens // 1000}k")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("endpoints")
        ax.set_ylabel(label)
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "scale-decision.png", dpi=100)
    plt.close(fig)
    lines += ["", "![decision latency and CPU](scale-decision.png)", ""]
    if earlier:
        lines += ["Beside other code, the same bench run within the hour on the same machine (`--label`: an "
                  "earlier commit's code, or `all-scored`, the current code with `--max-scored-endpoints 0`; "
                  f"repetitions: {_reps(earlier)}), at 4 and 256 endpoints:", "",
                  "| code | mode | endpoints | tokens | p50 ms | p99 ms | CPU ms/request |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for e in earlier:
            c = _find(rows, mode=e["mode"], endpoints=e["endpoints"], tokens=e["tokens"])
            for r in (e, c) if c else (e,):
                lines.append(f"| {r.get('code', 'current')} | {r['mode']} | {r['endpoints']} | {r['tokens']:,} | "
                             f"{_fmt(r, 'p50_ms')} | {_fmt(r, 'p99_ms')} | {_fmt(r, 'cpu_ms_per_request')} |")
        lines.append("")
    return lines


def tokenize_section(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["## Tokenization (`--part tokenize`)", "",
             f"Builtin tokenizer, median of each repetition's reads; repetitions: {_reps(rows)}. `cached prefix`: "
             "all but the last 4,096 tokens tokenized by an earlier request; `capped`: stopped at the precise "
             "lookup's reach (32,768 tokens), as precise mode does.", "",
             "| tokens | chars | cold ms | cached prefix ms | capped cold ms | capped cached prefix ms |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {_m(r, 'tokens'):,.0f} | {_m(r, 'chars'):,.0f} | {_fmt(r, 'cold_ms', 1)} | "
                     f"{_fmt(r, 'cached_prefix_ms', 1)} | {_fmt(r, 'capped_cold_ms', 1)} | "
                     f"{_fmt(r, 'capped_cached_prefix_ms', 1)} |")
    return [*lines, ""]


def memory_section(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["## Index memory at capacity (`--part memory`)", "",
             "Resident memory added by one index filled to capacity in a fresh process, against the index's "
             "own estimate (`approx_bytes`).", "",
             "| index | endpoints | entries | RSS MB | bytes/entry | estimate MB |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['endpoints']} | {_m(r, 'entries'):,.0f} | {_fmt(r, 'rss_mb', 0)} | "
                     f"{_fmt(r, 'bytes_per_entry', 0)} | {_fmt(r, 'estimate_mb', 0)} |")
    return [*lines, ""]


def stalls_section(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["## Pauses of the index updates (`--part stalls`, bench/scale_stalls.py)", "",
             f"Each index at capacity churned for one turnover (as many new blocks as it holds) in a fresh process, "
             f"every update timed; repetitions: {_reps(rows)}, mean (min-max). A stall: an update of 10 ms or more "
             "(wall time), all of it on the event loop; max CPU: the longest update in the thread's CPU time (a "
             "rebuild inside the update; wall time beyond it is the process waiting for a core). "
             "`code`: the index measured (an earlier commit's, run with `--label`, or the current one).", "",
             "| code | index | endpoints | updates | p50 ms | p99 ms | p99.9 ms | max ms | max CPU ms | stalls |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["kind"], r["endpoints"], r["code"] == "current")):
        lines.append(f"| {r['code']} | {r['kind']} | {r['endpoints']} | {_m(r, 'records'):,.0f} | "
                     f"{_fmt(r, 'p50_ms', 3)} | {_fmt(r, 'p99_ms', 2)} | {_fmt(r, 'p999_ms', 2)} | "
                     f"{_fmt(r, 'max_ms', 1)} | {_fmt(r, 'max_cpu_ms', 1) if 'max_cpu_ms' in r else 'n/a'} | "
                     f"{_fmt(r, 'stalls', 1)} |")
    return [*lines, ""]


def targets(doc: Doc) -> list[str]:
    lines = ["## Targets (on the means)", "", "| goal | value | bound | met |", "|---|---:|---:|---|"]

    def row(goal: str, value: float | None, bound: float) -> None:
        if value is None:
            lines.append(f"| {goal} | not measured | {bound:g} | n/a |")
        else:
            lines.append(f"| {goal} | {value:.3g} | {bound:g} | {'yes' if value <= bound else '**no**'} |")

    dec = [r for r in doc.get("decision", []) if r.get("code", "current") == "current"]
    for mode in ("approximate", "precise"):
        r = _find(dec, mode=mode, endpoints=256, tokens=8000)
        row(f"{mode}: decision p99 at 256 endpoints, 8k tokens (ms)", _m(r, "p99_ms") if r else None, 2.0)
        r = _find(dec, mode=mode, endpoints=256, tokens=128000)
        row(f"{mode}: decision p99 at 256 endpoints, 128k tokens (ms)", _m(r, "p99_ms") if r else None, 10.0)
        for tokens in (1000, 8000):
            a = _find(dec, mode=mode, endpoints=4, tokens=tokens)
            b = _find(dec, mode=mode, endpoints=256, tokens=tokens)
            ratio = _m(b, "cpu_ms_per_request") / _m(a, "cpu_ms_per_request") if a and b else None
            row(f"{mode}: CPU per request, 256 / 4 endpoints, {tokens // 1000}k tokens", ratio, 1.5)
    r = _find(doc.get("scrape", []), design="budgeted", endpoints=256)
    row("scraping 256 endpoints, budgeted (share of a core)", _m(r, "core_share") if r else None, 0.25)
    return [*lines, ""]


def render(doc: Doc, out: Path) -> str:
    lines = ["# How the cost grows (`python -m bench.scale`)", "",
             "In process on this machine (2 cores shared with other work; every part run under the shared CPU "
             "lock, one of its two slots: another heavy job may run on the other core), no model server: the "
             "picker's own work. Regenerate: `python -m bench.scale` (or one `--part` at a time, then "
             "`--render`). Per-repetition rows: bench/results/runs/scale-*.json.", ""]
    lines += targets(doc)
    if "scrape" in doc:
        lines += scrape_section(doc["scrape"], out)
    if "decision" in doc:
        lines += decision_section(doc["decision"], out)
    if "tokenize" in doc:
        lines += tokenize_section(doc["tokenize"])
    if "memory" in doc:
        lines += memory_section(doc["memory"])
    if "stalls" in doc:
        lines += stalls_section(doc["stalls"])
    return "\n".join(lines)
