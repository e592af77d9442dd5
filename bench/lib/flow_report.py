"""The flow-control benchmark's figures and report (`python -m bench.flow_control`).

`summarize(...)` turns one arm's run (`bench.lib.flow_traffic.TenantRun`, the engines' readings,
the picker's counters) into one row:
- interactive: requests sent after the warm-up and before the end of sending count; TTFT p50 /
  p99 (ms, `bench.lib.stats.percentile`) over the ones that succeeded, and the failures by kind;
- batch: every request sent; completed = OK / sent, errors by kind (`http_<status>`, `timeout`,
  `connection`, `truncated`); throughput = OK requests (and their output tokens) that ended
  between the warm-up and the end of sending, per second of that window;
- engines: per engine the readings, the most waiting / running / KV use seen, and a histogram of
  the waiting queue over the readings; `max_waiting` and `max_kv` over the engines;
- picker: `prefix_epp_flow_control_requests_total` by outcome (all priorities).

`aggregate(rows, arms)`: per arm, the mean of each figure over the repetitions with its 95%
interval (Student t on the repetitions' values: mean -/+ t975(n - 1) x sd / sqrt(n)), and for the
interactive p99 the paired ratio to `off` and to `unloaded` (`bench.lib.stats.paired_ratio`:
geometric mean of the per-repetition ratios, 95% interval on their logs). `verdicts(...)` checks
the issue's criteria; `render(data)` writes the markdown.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from bench.lib.flow_traffic import EngineSeen, TenantRun
from bench.lib.stats import PairedRatio, paired_ratio, percentile, t975

OFF, UNLOADED, FIFO, ROUND_ROBIN, GATE = "off", "unloaded", "fifo", "round-robin", "gate"
ARMS = (UNLOADED, OFF, FIFO, ROUND_ROBIN, GATE)


def summarize(run: TenantRun, warmup_s: float, engines: Sequence[EngineSeen], picker: dict[str, float],
              watch_interval_s: float, watch_rounds: int) -> dict[str, Any]:
    window = [r for r in run.interactive if warmup_s <= r.sent_s < run.sending_s]
    ok = [r for r in window if r.ok and r.ttft_s is not None]
    failed = Counter(("timeout" if r.error == "timeout" else f"http_{r.status}" if r.status and r.status != 200
                      else "error") for r in window if not (r.ok and r.ttft_s is not None))
    ttft = [1000 * (r.ttft_s or 0.0) for r in ok]
    batch_ok = [b for b in run.batch if b.ok]
    span = max(run.sending_s - warmup_s, 1e-9)
    in_window = [b for b in batch_ok if warmup_s <= b.end_s <= run.sending_s]
    return {
        "interactive": {"sent": len(window), "ok": len(ok), "errors": dict(failed),
                        "ttft_p50_ms": round(percentile(ttft, 50), 2), "ttft_p99_ms": round(percentile(ttft, 99), 2),
                        "ttft_max_ms": round(max(ttft), 2) if ttft else math.nan},
        "batch": {"sent": len(run.batch), "ok": len(batch_ok),
                  "errors": dict(Counter(b.kind for b in run.batch if not b.ok)),
                  "completed": round(len(batch_ok) / len(run.batch), 4) if run.batch else math.nan,
                  "rps": round(len(in_window) / span, 2),
                  "tokens_per_s": round(sum(b.tokens for b in in_window) / span, 1)},
        "engines": [e.summary() for e in engines],
        "max_waiting": max((e.max_waiting for e in engines if e.reads), default=math.nan),
        "max_kv": max((e.max_kv for e in engines if e.reads), default=math.nan),
        "watch": {"interval_s": watch_interval_s, "rounds": watch_rounds},
        "picker_outcomes": picker,
        "sending_s": round(run.sending_s, 2),
    }


def interval(values: Sequence[float]) -> dict[str, float]:
    """Mean of the finite values and its 95% Student-t interval (NaN bounds under 2 values)."""
    v = [x for x in values if isinstance(x, (int, float)) and math.isfinite(x)]
    if not v:
        return {"n": 0, "mean": math.nan, "low": math.nan, "high": math.nan}
    mean = math.fsum(v) / len(v)
    if len(v) < 2:
        return {"n": 1, "mean": mean, "low": math.nan, "high": math.nan}
    half = t975(len(v) - 1) * math.sqrt(math.fsum((x - mean) ** 2 for x in v) / (len(v) - 1)) / math.sqrt(len(v))
    return {"n": len(v), "mean": mean, "low": mean - half, "high": mean + half}


def _ratio(p: PairedRatio) -> dict[str, float]:
    return {"n": p.n, "ratio": p.ratio, "low": p.low, "high": p.high}


def aggregate(rows: Sequence[dict[str, Any]], arms: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per arm: figures over the repetitions, and paired ratios of the interactive p99 (module docstring)."""
    by_arm = {a: sorted((r for r in rows if r["arm"] == a), key=lambda r: r["repetition"]) for a in arms}
    reps = sorted({r["repetition"] for r in rows})

    def p99s(arm: str) -> list[float]:
        got = {r["repetition"]: r["interactive"]["ttft_p99_ms"] for r in by_arm.get(arm, [])}
        return [got.get(k, math.nan) for k in reps]

    out: dict[str, dict[str, Any]] = {}
    for arm, rs in by_arm.items():
        if not rs:
            continue
        sent, ok = sum(r["batch"]["sent"] for r in rs), sum(r["batch"]["ok"] for r in rs)
        errors: Counter[str] = Counter()
        for r in rs:
            errors.update(r["batch"]["errors"])
        out[arm] = {
            "repetitions": len(rs),
            "ttft_p50_ms": interval([r["interactive"]["ttft_p50_ms"] for r in rs]),
            "ttft_p99_ms": interval([r["interactive"]["ttft_p99_ms"] for r in rs]),
            "p99_vs_off": _ratio(paired_ratio(p99s(arm), p99s(OFF))) if OFF in by_arm else None,
            "p99_vs_unloaded": _ratio(paired_ratio(p99s(arm), p99s(UNLOADED))) if UNLOADED in by_arm else None,
            "batch_sent": sent, "batch_ok": ok, "batch_completed": ok / sent if sent else math.nan,
            "batch_errors": dict(errors),
            "batch_rps": interval([r["batch"]["rps"] for r in rs]),
            "batch_tokens_per_s": interval([r["batch"]["tokens_per_s"] for r in rs]),
            "max_waiting": max((r["max_waiting"] for r in rs), default=math.nan),
            "max_kv": max((r["max_kv"] for r in rs), default=math.nan),
        }
    return out


def verdicts(agg: dict[str, dict[str, Any]], queue_threshold: float) -> list[tuple[str, str, bool | None]]:
    """The issue's "Done when" criteria: (criterion, what was measured, holds; None where not measured)."""
    rr, gate = agg.get(ROUND_ROBIN), agg.get(GATE)
    checks: list[tuple[str, str, bool | None]] = []

    def check(what: str, measured: float, shown: str, limit: float, at_most: bool = True) -> None:
        holds = (measured <= limit if at_most else measured >= limit) if math.isfinite(measured) else None
        checks.append((what, shown, holds))

    if rr and rr["p99_vs_off"]:
        r = rr["p99_vs_off"]["ratio"]
        check("interactive TTFT p99, round-robin <= 0.5x off", r, f"{r:.2f}x", 0.5)
    if rr and rr["p99_vs_unloaded"]:
        r = rr["p99_vs_unloaded"]["ratio"]
        check("interactive TTFT p99, round-robin <= 2x unloaded", r, f"{r:.2f}x", 2.0)
    if rr:
        c = rr["batch_completed"]
        check("batch completed with round-robin >= 95%", c, f"{100 * c:.1f}%", 0.95, at_most=False)
    if gate:
        w = gate["max_waiting"]
        check(f"gate: every engine's waiting queue <= threshold + 1 = {queue_threshold + 1:g} at every reading",
              w, f"max {w:g}", queue_threshold + 1)
    return checks


def _ms(i: dict[str, float]) -> str:
    if not math.isfinite(i["mean"]):
        return "-"
    if not math.isfinite(i["low"]):
        return f"{i['mean']:.0f}"
    return f"{i['mean']:.0f} [{i['low']:.0f}, {i['high']:.0f}]"


def _x(r: dict[str, float] | None) -> str:
    if not r or not math.isfinite(r["ratio"]):
        return "-"
    if not math.isfinite(r["low"]):
        return f"{r['ratio']:.2f}x"
    return f"{r['ratio']:.2f}x [{r['low']:.2f}, {r['high']:.2f}]"


def _kinds(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "0"


def render(data: dict[str, Any]) -> str:
    agg, setup, load = data["aggregate"], data["setup"], data["load"]
    threshold = setup["queue_depth_threshold"]
    lines = [
        f"# Flow control: an interactive tenant beside a batch flood ({setup['backend_name']})", "",
        f"Run on {data['date']} at commit {data['commit']} with `{data['command']}`. Machine: {data['machine']}.", "",
        f"**Setup.** {setup['description']} Envoy ({data['envoy']}) in front of the picker (`prefix-epp serve`, "
        f"static endpoints, a fresh process per arm); every arm schedules with `inflight-load-scorer` alone, so "
        f"only flow control differs. Arms (interleaved within each repetition, the order rotated by one place per "
        f"repetition): {', '.join(f'`{a}`' for a in data['arms'])}; {data['repeat']} repetitions of "
        f"{data['seconds']:g} s of sending per arm, the first {data['warmup']:g} s not counted for the "
        f"interactive TTFT and the batch throughput.", "",
        f"**Load.** Interactive (`x-llm-d-inference-fairness-id: interactive`): open loop, "
        f"{load['interactive_rate']:g} requests/s, {load['interactive_prompt']} prompt tokens, "
        f"{load['interactive_tokens']} output tokens, streamed; TTFT at the client (first chunk with text). "
        f"Batch (`batch`): closed loop, {load['batch_concurrency']} requests in flight (the pool runs "
        f"{setup['slots']}), {load['batch_prompt']} prompt tokens, {load['batch_tokens'][0]}-"
        f"{load['batch_tokens'][1]} output tokens (uniform), not streamed. Both in the same priority band.", "",
        "**Arms.** `unloaded`: the interactive tenant alone, no flow control (the reference TTFT). `off`: both "
        "tenants, no flow control (the engines queue). `fifo`: `featureGates: [flowControl]`, "
        f"`concurrency-detector` at `maxConcurrency: {setup['slots_per_engine']}` (the engines' slots), "
        "`global-strict-fairness-policy` (one arrival order over both tenants). `round-robin`: the same with "
        "`round-robin-fairness-policy`. `gate`: flow control with `utilization-detector` at its defaults "
        f"(`queueDepthThreshold` {threshold:g}, `kvCacheUtilThreshold` {setup['kv_threshold']:g}) and the "
        f"picker's default scrape interval ({1000 * setup['scrape_interval_s']:.0f} ms), global-strict.", "",
        "## Interactive TTFT and the batch", "",
        "Mean over the repetitions [95% interval]; ratios: geometric mean of the per-repetition ratios of the "
        "interactive TTFT p99 [95% interval], paired by repetition.", "",
        "| arm | TTFT p50 (ms) | TTFT p99 (ms) | p99 / off | p99 / unloaded | batch completed (OK / sent) "
        "| batch errors | batch req/s | batch tokens/s |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for arm in data["arms"]:
        a = agg.get(arm)
        if not a:
            continue
        done = (f"{100 * a['batch_completed']:.1f}% ({a['batch_ok']} / {a['batch_sent']})"
                if a["batch_sent"] else "-")
        lines.append(f"| {arm} | {_ms(a['ttft_p50_ms'])} | {_ms(a['ttft_p99_ms'])} | "
                     f"{'1' if arm == OFF else _x(a['p99_vs_off'])} | "
                     f"{'1' if arm == UNLOADED else _x(a['p99_vs_unloaded'])} | {done} | "
                     f"{_kinds(a['batch_errors']) if a['batch_sent'] else '-'} | "
                     f"{_ms(a['batch_rps']) if a['batch_sent'] else '-'} | "
                     f"{_ms(a['batch_tokens_per_s']) if a['batch_sent'] else '-'} |")
    lines += [
        "", "## Overshoot: the engines' queues with the gate on", "",
        f"Every engine's `/metrics` read every {1000 * setup['watch_interval_s']:.0f} ms (the picker's default "
        f"scrape interval; the picker itself scrapes an engine whose page is slow to render less often, "
        f"`--scrape-engine-share`) throughout each arm, the next round once the slower read of the last is "
        f"done: `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`. With the gate "
        f"(`utilization-detector`), no reading should exceed the detector's queue-depth threshold + 1 = "
        f"{threshold + 1:g}.", "",
        "| arm | readings (failed) | most waiting, any engine | readings above threshold + 1 | most KV use |",
        "|---|---:|---:|---:|---:|",
    ]
    for arm in data["arms"]:
        rs = [r for r in data["runs"] if r["arm"] == arm]
        reads = sum(e["reads"] for r in rs for e in r["engines"])
        failed = sum(e["failed_reads"] for r in rs for e in r["engines"])
        above = sum(n for r in rs for e in r["engines"] for k, n in e["waiting_histogram"].items()
                    if int(k) > threshold + 1)
        if arm in agg:
            lines.append(f"| {arm} | {reads} ({failed}) | {agg[arm]['max_waiting']:g} | {above} | "
                         f"{100 * agg[arm]['max_kv']:.1f}% |")
    lines += ["", "## The criteria of issue 68", "", "| criterion | measured | holds |", "|---|---:|---|"]
    for what, measured, holds in data["verdicts"]:
        lines.append(f"| {what} | {measured} | {'-' if holds is None else 'yes' if holds else 'no'} |")
    lines += ["", "## Every run", "",
              "| repetition | position | arm | interactive OK / sent | TTFT p50 | TTFT p99 | TTFT max "
              "| batch OK / sent | batch errors | batch req/s | most waiting | most KV | picker outcomes | problems |",
              "|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---|"]
    for r in data["runs"]:
        i, b = r["interactive"], r["batch"]
        outcomes = ", ".join(f"{k} {v:g}" for k, v in sorted(r["picker_outcomes"].items())) or "-"
        lines.append(f"| {r['repetition'] + 1} | {r['position'] + 1} | {r['arm']} | {i['ok']} / {i['sent']} | "
                     f"{i['ttft_p50_ms']:.1f} | {i['ttft_p99_ms']:.1f} | {i['ttft_max_ms']:.1f} | "
                     f"{b['ok']} / {b['sent']} | {_kinds(b['errors']) if b['sent'] else '-'} | {b['rps']:g} | "
                     f"{r['max_waiting']:g} | {100 * r['max_kv']:.1f}% | {outcomes} | "
                     f"{'; '.join(r['problems']) or '-'} |")
    return "\n".join(lines) + "\n"
