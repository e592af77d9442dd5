"""The Markdown tables of a benchmark run (bench.run writes them into {name}.md).

- `results_table`: one row per (workload, router) plus the oracle bound; with repetitions the
  row holds the means, and the figures that vary from run to run (hit rate, TTFT, e2e, load
  balance, decision latency) carry their min-max range: `1,914 (1,850-2,010)`.
- `accuracy_table`: the prefix-epp setups' closed-loop prediction of cached tokens.
- `ttft_split_table`: on real engines, the client's mean TTFT against the engines' own, and the
  Envoy setups' time to the upstream request.
- `targets_table`: the goals of `bench.lib.targets.TARGETS`, met or missed (on the means).
- `clairvoyant_table`: every router's hit rate and TTFT p99 as a fraction of the clairvoyant
  reference's (`bench.lib.targets.relative_to`).
- `paired_table`: every arm against the reference arm (`bench.lib.aggregate.paired_figures`):
  per figure the mean over the repetitions, x the geometric mean of the paired ratios with its
  95% interval, and "better" / "worse" only where the interval excludes 1.
- `path_table`: the path's own time: Envoy's first byte to upstream request (p50 / p99, from
  the access log), the picker's decision (p50 / p99, its histogram) and the router's CPU per request.
- `bound_table`: every router's hit rate against the finite-cache bound of its own runs
  (`bench.lib.cache_bound`) and, on real engines, against the placement reference
  (`bench.lib.placement_reference`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench.lib.aggregate import Spread, cell
from bench.lib.targets import Target, relative_to

Rows = Mapping[str, Mapping[str, Mapping[str, Any]]]


def fmt(value: float, digits: int = 0) -> str:
    return "-" if value != value else f"{value:,.{digits}f}"  # NaN -> "-"


def _pct(value: float) -> str:
    return "-" if value != value else f"{value:.1%}"


def _ratio(value: float) -> str:
    return "-" if value != value else f"{value:.2f}"


def _ms2(value: float) -> str:
    return fmt(value, 2)


def results_table(summaries: Rows, oracle: Mapping[str, float],
                  spreads: Mapping[str, Mapping[str, Spread]] | None = None) -> str:
    """With real engines (rows with `engine_hit_rate`) an "engine hit rate" column follows "hit rate"."""
    engines = any("engine_hit_rate" in r for rows in summaries.values() for r in rows.values())
    lines = [
        "| workload | router | hit rate | " + ("engine hit rate | " if engines else "") + "of oracle "
        "| prefill work (s) | TTFT p50 | p90 | p99 | e2e p50 | p99 "
        "| output tok/s | load max/mean | errors | decision p50 / p99 (ms) | router CPU ms/req |",
        "|---|---|---:|" + ("---:|" if engines else "") + "---:|" * 12,
    ]
    for workload, rows in summaries.items():
        bound = oracle.get(workload, 0.0)
        if bound:
            lines.append(f"| {workload} | *oracle (infinite cache)* | {bound:.1%} | " + ("| " if engines else "")
                         + "100% | | | | | | | | | | | |")
        for router, r in rows.items():
            spread = (spreads or {}).get(workload, {}).get(router, {})

            def c(path: str, value: float, f: Any = fmt, s: Spread = spread) -> str:
                return cell(value, s.get(path), f)

            of_oracle = f"{r['hit_rate'] / bound:.1%}" if bound else "-"
            d = r.get("decision_ms")
            decision = f"{c('decision_ms.p50', d['p50'], _ms2)} / {c('decision_ms.p99', d['p99'], _ms2)}" if d else ""
            t, e = r["ttft_ms"], r["e2e_ms"]
            engine = f" {c('engine_hit_rate', r.get('engine_hit_rate', float('nan')), _pct)} |" if engines else ""
            lines.append(
                f"| {workload} | {router} | {c('hit_rate', r['hit_rate'], _pct)} |{engine} {of_oracle} "
                f"| {fmt(r['prefill_work_s'])} | {c('ttft_ms.p50', t['p50'])} | {c('ttft_ms.p90', t['p90'])} "
                f"| {c('ttft_ms.p99', t['p99'])} | {c('e2e_ms.p50', e['p50'])} | {c('e2e_ms.p99', e['p99'])} "
                f"| {fmt(r['output_tokens_per_s'])} | {c('replica_max_over_mean', r['replica_max_over_mean'], _ratio)} "
                f"| {fmt(r['errors'], 0 if float(r['errors']).is_integer() else 1)} "
                f"| {decision} | {fmt(r.get('router_cpu_ms_per_request', float('nan')), 2)} |")
    return "\n".join(lines)


def ttft_split_table(summaries: Rows) -> str:
    """Real engines: each router's mean TTFT at the client against the engines' own mean (their
    TTFT histogram), the difference being what the way there added (gateway, picker or proxy, the
    engine's HTTP server); and, for the Envoy setups, Envoy's first byte to upstream request.
    '' without engine figures."""
    lines = ["| workload | router | TTFT mean (client) | engines' TTFT mean | the way there (client - engines) "
             "| engines' queue mean | Envoy to upstream mean / p50 / p99 |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for workload, rows in summaries.items():
        for router, r in rows.items():
            engine = r.get("engine_ttft_ms_mean")
            if engine is None:
                continue
            client = r.get("ttft_ms_mean", float("nan"))
            g = r.get("gateway_ms")
            gateway = f"{fmt(g['mean'], 1)} / {fmt(g['p50'], 1)} / {fmt(g['p99'], 1)}" if g else "-"
            lines.append(f"| {workload} | {router} | {fmt(client)} | {fmt(engine)} | {fmt(client - engine)} "
                         f"| {fmt(r.get('engine_queue_ms_mean', float('nan')), 1)} | {gateway} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def accuracy_table(summaries: Rows) -> str:
    """Per prefix-epp router: hit rate, TTFT p90/p99 and both scorers' closed-loop prediction accuracy."""
    lines = ["| workload | router | hit rate | TTFT p90 | p99 | scorer | predictions | within one block "
             "| MAE (tokens) |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for workload, rows in summaries.items():
        for router, r in rows.items():
            for scorer, acc in r.get("prediction", {}).items():
                t = r["ttft_ms"]
                lines.append(f"| {workload} | {router} | {r['hit_rate']:.1%} | {fmt(t['p90'])} | {fmt(t['p99'])} "
                             f"| {scorer} | {fmt(acc['predictions'])} | {fmt(acc['within_one_block'] * 100, 1)}% "
                             f"| {fmt(acc['mae_tokens'])} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _num(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 10 else f"{value:.3g}"


def targets_table(targets: Mapping[str, list[Target]]) -> str:
    lines = ["| router | workload | goal | value | bound | met |", "|---|---|---|---:|---:|---|"]
    for candidate, rows in targets.items():
        for t in rows:
            verdict = "yes" if t.met else f"**no** (by {t.miss})"
            lines.append(f"| {candidate} | {t.workload} | {t.goal} | {_num(t.value)} | {_num(t.bound)} | {verdict} |")
    return "\n".join(lines)


def clairvoyant_table(summaries: Rows) -> str:
    """'' when the clairvoyant reference did not run."""
    relative = relative_to(summaries)
    lines = ["| workload | router | hit rate / clairvoyant | TTFT p99 / clairvoyant |", "|---|---|---:|---:|"]
    for workload, rows in relative.items():
        for router, r in rows.items():
            if router != "clairvoyant":
                lines.append(f"| {workload} | {router} | {_ratio(r['hit_rate'])} | {_ratio(r['ttft_p99'])} |")
    return "\n".join(lines) if len(lines) > 2 else ""


PAIRED_TITLES = {"hit_rate": "hit rate", "hit_of_reference": "hit / placement reference", "ttft_ms.p50": "TTFT p50",
                 "ttft_ms.p90": "TTFT p90", "ttft_ms.p99": "TTFT p99", "gateway_ms.p99": "path p99 (ms)"}


def paired_cell(path: str, f: Mapping[str, Any] | None) -> str:
    if f is None:
        return "-"
    mean = _pct(f["mean"]) if path.startswith("hit") else fmt(f["mean"], 1 if path.startswith("gateway") else 0)
    if "ratio" not in f:
        return mean
    interval = f"{_bound(f['low'])}-{_bound(f['high'])}" if f["low"] == f["low"] else f"n={f['n']}"
    claim = f" **{f['verdict']}**" if f["verdict"] else ""
    return f"{mean} x{_ratio3(f['ratio'])} [{interval}]{claim}"


def _ratio3(value: float) -> str:
    return "-" if value != value else f"{value:.3f}"


def _bound(value: float) -> str:
    """3 decimals, more where a bound other than 1 would read 1.000 (and so seem to hold 1)."""
    for digits in range(3, 7):
        text = f"{value:.{digits}f}"
        if value == 1.0 or float(text) != 1.0:
            return text
    return text


def paired_table(figures: Mapping[str, Mapping[str, Mapping[str, Mapping[str, Any]]]], reference: str) -> str:
    """'' without figures; a column per figure any arm has (PAIRED_TITLES' order)."""
    paths = [p for p in PAIRED_TITLES if any(p in arm for rows in figures.values() for arm in rows.values())]
    if not paths:
        return ""
    lines = ["| workload | arm | " + " | ".join(PAIRED_TITLES[p] for p in paths) + " |",
             "|---|---|" + "---:|" * len(paths)]
    for workload, rows in figures.items():
        for router, arm in rows.items():
            name = f"{router} (reference)" if router == reference else router
            lines.append(f"| {workload} | {name} | " + " | ".join(paired_cell(p, arm.get(p)) for p in paths) + " |")
    return "\n".join(lines)


def path_table(summaries: Rows, spreads: Mapping[str, Mapping[str, Spread]] | None = None) -> str:
    """The setups with a measured path (Envoy's access log or a picker's decision histogram); ''
    where none has one."""
    lines = ["| workload | router | Envoy to upstream p50 | p99 | decision p50 | p99 | router CPU ms/req |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for workload, rows in summaries.items():
        for router, r in rows.items():
            g, d = r.get("gateway_ms"), r.get("decision_ms")
            if not g and not d:
                continue
            spread = (spreads or {}).get(workload, {}).get(router, {})
            cells = [cell(v[q], spread.get(f"{key}.{q}"), _ms2) if v else "-"
                     for key, v in (("gateway_ms", g), ("decision_ms", d)) for q in ("p50", "p99")]
            lines.append(f"| {workload} | {router} | " + " | ".join(cells)
                         + f" | {fmt(r.get('router_cpu_ms_per_request', float('nan')), 2)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def carried(summaries: Rows, key: str) -> bool:
    """Whether any (workload, router) row carries `key`."""
    return any(key in r for rows in summaries.values() for r in rows.values())


def bound_table(summaries: Rows, oracle: Mapping[str, float]) -> str:
    """Hit rate against the finite-cache bound of the same sends (`hit_bound`, each run's; means
    over the repetitions), beside the infinite-cache oracle; where the runs carry the placement
    reference (`hit_reference`, real engines), it and the hit rate's share of it too, and where some
    carry the replay of their own placement (`hit_replayed`), that; '' where no run carries a bound."""
    optional = [(key, title) for key, title in (("hit_reference", "placement reference | of reference"),
                                                 ("hit_replayed", "its placement replayed"))
                if carried(summaries, key)]
    head = "".join(f" {title} |" for _, title in optional)
    rule = "".join("---:|" * (title.count("|") + 1) for _, title in optional)
    lines = [f"| workload | router | hit rate | finite-cache bound | of bound |{head} infinite-cache oracle |",
             f"|---|---|---:|---:|---:|{rule}---:|"]
    for workload, rows in summaries.items():
        for router, r in rows.items():
            bound = r.get("hit_bound")
            if bound is None:
                continue
            cells = [_pct(r["hit_rate"]), _pct(bound), _pct(r["hit_rate"] / bound) if bound else "-"]
            for key, _ in optional:
                value = r.get(key)
                cells.append("-" if value is None else _pct(value))
                if key == "hit_reference":
                    cells.append(_pct(r["hit_rate"] / value) if value else "-")
            cells.append(_pct(oracle.get(workload, 0.0)))
            lines.append(f"| {workload} | {router} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""
