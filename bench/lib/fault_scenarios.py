"""One fault under steady traffic through a fresh quick-start stack (`testkit.quickstart`).

`run_scenario(name, source, tmp, timing)` starts the stack with `source`'s picker, waits for a
replica to answer through it (`fault_traffic.wait_routed`), starts `fault_traffic.Traffic`, then:

1. warms up: at least `timing.before_s` seconds and `timing.warm_requests` successful answers;
2. applies the fault (below), holding it as long as the scenario says;
3. keeps the traffic on for `timing.after_s` seconds after the fault ended (with
   `timing.stop_when_recovered`, less: until `RECOVERY_RUN` consecutive requests sent after the
   fault's end have succeeded), then stops sending and waits for the answers in flight.

Faults (`SCENARIOS`). The faulty replica of `replica-kill` and `replica-freeze` is the one that
served the most requests during the warm-up (the fault meets traffic); `replica-500`'s is replica
0. The fault starts when its signal is sent and ends when the scenario says:

- `replica-kill`: SIGKILL, `fault_s` later the same command restarted on the same port; the
  fault ends once the new process accepts connections.
- `replica-freeze`: SIGSTOP, `fault_s` later SIGCONT (the end).
- `replica-500`: the replica runs with `--failure-rate 1.0` from the start (every inference
  request answered 500, /metrics and /health healthy); the fault spans the whole run
  (`fault_start_s` 0, no end), which lasts `before_s + fault_s + after_s`.
- `picker-kill`: once a streamed generation is open (its 200 received; at most 5 s after the
  warm-up), SIGKILL to the picker; `picker_down_s` later it is started again on the same ports;
  the fault ends when its readiness service answers SERVING.
- `picker-sigterm`: once a stream is open, SIGTERM to the picker's main process (the picker runs
  with `--drain-timeout <timing.drain_timeout_s>`), never restarted; the fault ends when the
  process exits (exit status and seconds to exit recorded); traffic stops 1 s later (with a
  single picker there is nothing to route new requests after that). No recovery is measured.

Everything the summary needs is in the returned `ScenarioRun` (`bench.lib.fault_summary`).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.lib.fault_summary import RECOVERY_RUN, ScenarioRun, recovered_after
from bench.lib.fault_traffic import Traffic, wait_routed
from testkit.quickstart import QUICKSTART_ENVOY_CONFIG_ARGS, QUICKSTART_PICKER_ARGS, QuickStart, Source, quickstart

SCENARIOS = ("replica-kill", "replica-freeze", "replica-500", "picker-kill", "picker-sigterm")
OPEN_STREAM_WAIT_S = 5.0  # at most this long after the warm-up for a stream to be open at a picker fault


@dataclass(frozen=True)
class Timing:
    before_s: float = 10.0
    fault_s: float = 10.0  # a replica's kill or freeze
    after_s: float = 12.0
    picker_down_s: float = 1.5  # picker-kill: from SIGKILL to the restart
    drain_timeout_s: float = 10.0  # picker-sigterm: the picker's --drain-timeout
    warm_requests: int = 20
    stop_when_recovered: bool = False


@dataclass(frozen=True)
class Load:
    """`bench.lib.fault_traffic.Traffic`'s knobs."""

    clients: int = 6
    rate: float = 20.0
    max_tokens: int = 128
    seed: int = 0


@dataclass
class Stack:
    """What the scenario hands to `quickstart` besides the source tree."""

    picker_args: Sequence[str] = QUICKSTART_PICKER_ARGS
    envoy_config_args: Sequence[str] = QUICKSTART_ENVOY_CONFIG_ARGS
    sim_args: Sequence[str] = ()
    time_scale: float = 10.0


async def _until(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not (callable(cond) and cond()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not met in {timeout} s")
        await asyncio.sleep(0.02)


def _busiest(traffic: Traffic, addresses: list[str]) -> int:
    counts = Counter(o.routed_to for o in traffic.outcomes if o.ok)
    return max(range(len(addresses)), key=lambda i: (counts[addresses[i]], -i))


async def run_scenario(name: str, source: Source, tmp: Path, timing: Timing = Timing(), load: Load = Load(),
                       stack: Stack | None = None) -> ScenarioRun:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}: one of {SCENARIOS}")
    stack = stack or Stack()
    picker_args = list(stack.picker_args)
    if name == "picker-sigterm":
        picker_args += ["--drain-timeout", f"{timing.drain_timeout_s}s"]
    rates = {0: 1.0} if name == "replica-500" else None
    with quickstart(tmp, source, time_scale=stack.time_scale, failure_rates=rates, sim_args=stack.sim_args,
                    picker_args=picker_args, envoy_config_args=stack.envoy_config_args) as qs:
        await wait_routed(qs.url)
        traffic = Traffic(qs.url, clients=load.clients, rate=load.rate, max_tokens=load.max_tokens, seed=load.seed)
        stop = asyncio.Event()
        sending = asyncio.create_task(traffic.run(stop))
        run = ScenarioRun(scenario=name)
        try:
            await _drive(name, qs, traffic, timing, stop, run)
        except (RuntimeError, TimeoutError) as exc:  # a restart that failed is a result too
            run.problems.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        finally:
            stop.set()
            outcomes = await sending
        run.outcomes = outcomes
        run.end_s = max((o.end_s for o in outcomes), default=traffic.now())
        run.problems += qs.dead(picker_expected=name != "picker-sigterm")
    run.arm, run.commit, run.envoy_config = (source.label, source.commit(),
                                                  " ".join(["prefix-epp", *qs.envoy_config[4:]]))
    return run


async def _drive(name: str, qs: QuickStart, traffic: Traffic, timing: Timing, stop: asyncio.Event,
                 run: ScenarioRun) -> None:
    """The scenario's timeline, while `traffic` runs; stamps the fault on `run`."""
    addresses = [r.address for r in qs.replicas]
    if name == "replica-500":
        run.faulty, run.fault_start_s = addresses[0], 0.0
        await asyncio.sleep(timing.before_s + timing.fault_s + timing.after_s)
        return
    await _until(lambda: traffic.now() >= timing.before_s
                 and sum(o.ok for o in traffic.outcomes) >= timing.warm_requests,
                 timing.before_s + 60.0, "warm-up")
    if name in ("replica-kill", "replica-freeze"):
        replica = qs.replicas[_busiest(traffic, addresses)]
        run.faulty = replica.address
        if name == "replica-kill":
            run.fault_start_s = traffic.now()
            await asyncio.to_thread(replica.kill)
            await asyncio.sleep(timing.fault_s)
            await asyncio.to_thread(replica.start)
        else:
            run.fault_start_s = traffic.now()
            replica.freeze()
            await asyncio.sleep(timing.fault_s)
            replica.thaw()
        run.fault_end_s = traffic.now()
    else:
        try:
            await _until(lambda: traffic.open_streams() > 0, OPEN_STREAM_WAIT_S, "an open stream")
        except TimeoutError:
            run.problems.append("no stream was open when the picker was signalled")
        if name == "picker-kill":
            run.fault_start_s = traffic.now()
            await asyncio.to_thread(qs.picker.kill)
            await asyncio.sleep(timing.picker_down_s)
            await asyncio.to_thread(qs.picker.start)
            run.fault_end_s = traffic.now()
        else:
            await _sigterm(qs, traffic, timing, run, stop)
            return
    await _after(traffic, timing, run)


async def _after(traffic: Traffic, timing: Timing, run: ScenarioRun) -> None:
    fault_end = run.fault_end_s or 0.0
    end = fault_end + timing.after_s
    if not timing.stop_when_recovered:
        await asyncio.sleep(max(0.0, end - traffic.now()))
        return

    def recovered() -> bool:
        later = [o for o in traffic.outcomes if o.sent_s >= fault_end]
        return recovered_after(later, fault_end) is not None

    with contextlib.suppress(TimeoutError):  # not recovered: the summary says so
        await _until(recovered, max(0.0, end - traffic.now()), f"{RECOVERY_RUN} successes in a row")


async def _sigterm(qs: QuickStart, traffic: Traffic, timing: Timing, run: ScenarioRun,
                   stop: asyncio.Event) -> None:
    run.recovers = False
    run.fault_start_s = traffic.now()
    qs.picker.terminate()
    try:
        run.picker_exit = await asyncio.to_thread(qs.picker.wait, timing.drain_timeout_s + 15.0)
        run.fault_end_s = traffic.now()
        run.picker_exit_s = run.fault_end_s - run.fault_start_s
    except subprocess.TimeoutExpired:
        run.problems.append(f"the picker had not exited {timing.drain_timeout_s + 15.0:.0f} s after SIGTERM")
    await asyncio.sleep(1.0)
    stop.set()
