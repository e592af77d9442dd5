"""The README's quick-start stack on 127.0.0.1, each part a process that a fault can hit alone.

The README runs `prefix-epp sim --replicas 3 --base-port P --time-scale 10`, `prefix-epp serve
--endpoints $EPS --max-endpoints 2 --secure-serving=false --explain-decisions`, `prefix-epp
envoy-config --listen-port L --epp 127.0.0.1:G --epp-tls=false --endpoints $EPS > envoy.yaml` and
`envoy -c envoy.yaml --concurrency 1`. Here the same commands run with these differences, all needed to break one part
at a time:

- each replica is its own simulator process (`--replicas 1 --port p_i`), so one can be killed,
  frozen or restarted on its port while the others serve; without KV events (`--no-kv-events`:
  three processes would all bind the default event port, and the quick start's picker does not
  subscribe to them);
- every port is a free one (`testkit.procs.free_ports`); the picker binds 127.0.0.1 and its health
  and metrics ports are given too; Envoy gets an admin port and `--base-id` (several Envoys on
  one host) and logs at warning level;
- the picker and `envoy-config` run from a `Source` tree (`PYTHONPATH=<tree>`, `python -P -m
  extproc`: the interpreter puts no working directory ahead of it), so two checkouts of the
  picker can be compared in front of the same simulator, which always runs from this tree.
  `envoy-config` runs as that tree's command, so its defaults (fallbacks, fail-open) are the
  tree's own; `envoy_config_args` adds flags to it, `picker_args` to `serve`. In both,
  `{endpoints}` stands for the replicas' addresses (`ip:port,...`), which are free ports picked
  at start: `--endpoints={endpoints}` gives envoy-config the static endpoint list.

`quickstart(tmp, source, ...)` yields a `QuickStart` once Envoy's listener accepts connections and
the picker's readiness service answers SERVING; everything is stopped on the way out (a frozen
replica is thawed first). Its `Replica`s and picker take the faults: `kill` (SIGKILL to the
process group), `freeze` (SIGSTOP) / `thaw` (SIGCONT), `restart` (the same command on the same
ports), and for the picker `terminate` (SIGTERM to the main process, as Kubernetes sends it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from testkit.envoy import envoy_binary
from testkit.picker import wait_ready
from testkit.procs import REPO_ROOT, Proc, free_ports, python_module, wait_for_port

QUICKSTART_TIME_SCALE = 10.0  # the README's `--time-scale 10`
# The README's serve flags beyond the endpoints, and its envoy-config flags beyond the addresses.
QUICKSTART_PICKER_ARGS = ("--max-endpoints", "2", "--explain-decisions")
QUICKSTART_ENVOY_CONFIG_ARGS = ("--endpoints={endpoints}",)


@dataclass(frozen=True)
class Source:
    """A checkout of the project whose picker and `envoy-config` run (`label`: its name in reports)."""

    label: str
    root: Path

    @property
    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": str(self.root)}

    def argv(self, *args: str) -> list[str]:
        """`prefix-epp ARGS` from this tree (-P: the working directory does not shadow it)."""
        return [sys.executable, "-P", "-m", "extproc", *args]

    def commit(self) -> str:
        """The tree's commit (short hash), with `+dirty` when it has uncommitted changes."""
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(self.root), *args], capture_output=True, text=True,
                                  check=False).stdout.strip()
        head = git("rev-parse", "--short", "HEAD") or "unknown"
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


HERE = Source("here", REPO_ROOT)


def _signal_group(proc: Proc, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


@dataclass
class Replica:
    """One simulated vLLM replica as its own process on `port`."""

    port: int
    args: list[str]
    log: Path
    proc: Proc | None = None
    frozen: bool = False
    starts: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.starts += 1
        self.proc = Proc(self.args, self.log.with_suffix(f".{self.starts}.log"))
        try:
            wait_for_port(self.port, proc=self.proc.popen)
        except Exception as exc:
            raise RuntimeError(f"replica {self.address} did not start: {exc}\n{self.proc.log_text()[-3000:]}") from exc

    def kill(self) -> None:
        """SIGKILL: the process vanishes, its connections are reset, its port refuses connections."""
        if self.proc is not None:
            _signal_group(self.proc, signal.SIGKILL)
            self.proc.popen.wait()
            self.proc.stop()

    def freeze(self) -> None:
        """SIGSTOP: connections stay open and accepted, nothing is answered (a hung engine)."""
        if self.proc is not None:
            _signal_group(self.proc, signal.SIGSTOP)
            self.frozen = True

    def thaw(self) -> None:
        if self.proc is not None and self.frozen:
            _signal_group(self.proc, signal.SIGCONT)
        self.frozen = False

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        self.thaw()
        if self.proc is not None:
            self.proc.stop()


@dataclass
class PickerProc:
    """`prefix-epp serve` of a `Source` on fixed ports, restartable on the same ports."""

    source: Source
    args: list[str]
    health_port: int
    log: Path
    proc: Proc | None = None
    starts: int = 0

    def start(self) -> None:
        self.starts += 1
        self.proc = Proc(self.args, self.log.with_suffix(f".{self.starts}.log"), env=self.source.env)
        wait_ready(self.health_port, self.proc)

    def kill(self) -> None:
        if self.proc is not None:
            _signal_group(self.proc, signal.SIGKILL)
            self.proc.popen.wait()
            self.proc.stop()

    def terminate(self) -> None:
        """SIGTERM to the picker's main process only (the kubelet signals a container's PID 1)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)

    def wait(self, timeout: float | None = None) -> int:
        """The exit status once the main process has exited (subprocess.TimeoutExpired meanwhile)."""
        assert self.proc is not None
        return self.proc.popen.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def log_text(self) -> str:
        return self.proc.log_text() if self.proc is not None else ""


@dataclass
class QuickStart:
    source: Source
    replicas: list[Replica]
    picker: PickerProc
    envoy: Proc
    envoy_port: int
    admin_port: int
    envoy_config: list[str] = field(default_factory=list)  # the envoy-config command that wrote envoy.yaml

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    def dead(self, picker_expected: bool = True) -> list[str]:
        """What exited that should be running: Envoy, a replica, the picker (unless not expected)."""
        procs = [("envoy", self.envoy), *((f"replica {r.address}", r.proc) for r in self.replicas)]
        if picker_expected:
            procs.append(("picker", self.picker.proc))
        return [f"{name} exited with {p.popen.returncode}" if p is not None else f"{name} not running"
                for name, p in procs if p is None or not p.alive()]


def replica_args(port: int, time_scale: float, failure_rate: float, sim_args: Sequence[str]) -> list[str]:
    args = python_module("prefix_epp_sim.cli", "--replicas", "1", "--port", str(port), "--time-scale",
                         str(time_scale), "--no-kv-events", *sim_args)
    return [*args, "--failure-rate", str(failure_rate)] if failure_rate else args


@contextlib.contextmanager
def quickstart(tmp: Path, source: Source = HERE, *, replicas: int = 3, time_scale: float = QUICKSTART_TIME_SCALE,
               failure_rates: dict[int, float] | None = None, sim_args: Sequence[str] = (),
               picker_args: Sequence[str] = QUICKSTART_PICKER_ARGS,
               envoy_config_args: Sequence[str] = QUICKSTART_ENVOY_CONFIG_ARGS) -> Iterator[QuickStart]:
    """The quick-start stack (module docstring); `failure_rates`: replica index -> `--failure-rate`."""
    tmp.mkdir(parents=True, exist_ok=True)
    ports = free_ports(replicas + 5)
    replica_ports, (grpc, health, metrics, listen, admin) = ports[:replicas], ports[replicas:]
    rates = failure_rates or {}
    reps = [Replica(p, replica_args(p, time_scale, rates.get(i, 0.0), sim_args), tmp / f"replica-{i}")
            for i, p in enumerate(replica_ports)]
    endpoints = ",".join(r.address for r in reps)
    picker_args = [a.replace("{endpoints}", endpoints) for a in picker_args]
    envoy_config_args = [a.replace("{endpoints}", endpoints) for a in envoy_config_args]
    picker = PickerProc(source, source.argv(
        "serve", "--endpoints", endpoints, "--secure-serving=false", "--grpc-port", str(grpc),
        "--grpc-health-port", str(health), "--metrics-port", str(metrics), "--bind-address", "127.0.0.1",
        *picker_args), health, tmp / "picker")
    config_cmd = source.argv("envoy-config", "--listen-port", str(listen), "--epp", f"127.0.0.1:{grpc}",
                             "--epp-tls=false", "--admin-port", str(admin), *envoy_config_args)
    made = subprocess.run(config_cmd, capture_output=True, text=True, env={**os.environ, **source.env},
                          check=False, timeout=60)
    if made.returncode != 0:
        raise RuntimeError(f"envoy-config failed ({made.returncode}): {made.stderr[-3000:]}")
    (tmp / "envoy.yaml").write_text(made.stdout)
    envoy: Proc | None = None
    try:
        for r in reps:
            r.start()
        picker.start()
        envoy = Proc([envoy_binary(), "-c", str(tmp / "envoy.yaml"), "--concurrency", "1", "--log-level", "warning",
                      "--base-id", str(listen)], tmp / "envoy.log")
        try:
            wait_for_port(listen, proc=envoy.popen)
        except Exception as exc:
            raise RuntimeError(f"envoy did not start: {exc}\n{envoy.log_text()[-3000:]}") from exc
        yield QuickStart(source, reps, picker, envoy, listen, admin, config_cmd)
    finally:
        if envoy is not None:
            envoy.stop()
        picker.stop()
        for r in reps:
            r.stop()
