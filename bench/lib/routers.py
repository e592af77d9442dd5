"""Start and stop the simulated replicas and each router setup the benchmark compares.

Everything listens on 127.0.0.1 and runs as a child process in its own process group
(`testkit.procs.running`): leaving a `with` block, an exception or Ctrl-C stops it (TERM,
then KILL). Setups, all in front of the same replicas:

- `random`, `round-robin`, `least-request`: Envoy alone, lb_policy RANDOM / ROUND_ROBIN /
  LEAST_REQUEST (Envoy's default: the less loaded of 2 random hosts) over a STATIC cluster of
  the replicas (`testkit.envoy.plain_envoy_config`).
- `prefix-epp`: `python -m extproc serve --endpoints ... --secure-serving=false` (default
  scheduling unless `picker_args` add flags) behind Envoy configured by
  `extproc.commands.envoy_config.build_config` (full-duplex ext_proc, override_host cluster).
- `prefix-epp-weighted`: the same with `--scheduler weighted` (the weighted-sum scoring profile
  instead of the default predicted-TTFT scheduler).
- `prefix-epp-cache-aware`: the same with `--scheduler cache-aware` (the reference policy,
  sglang-router's cache_aware inside the picker): policy against policy with the path held equal.
- `prefix-epp-precise`: the same with `--prefix-scorer precise`: the picker subscribes to the
  replicas' KV events (`host:port@tcp://events@tcp://replay` endpoints) and routes on them.
  Whenever the replicas publish events, plain `prefix-epp` also gets them, with `--kv-events`
  (it still routes approximately), so both setups report both scorers' closed-loop accuracy.
- `go-epp`: the Go endpoint picker of the Gateway API Inference Extension v1.5.0 with its
  default configuration, behind Envoy with the reference ext_proc modes (full-duplex request and
  response bodies) and the same override_host cluster, reading its pool and pods from a real
  kube-apiserver (`bench.lib.go_epp`). Available when Go is installed or the
  binary is already cached (`go_epp_available`). Plaintext ext_proc, like every picker here
  (`PICKER_TRANSPORT`, which the report states).
- `llm-d`, `llm-d-precise`: llm-d's router (the binary `LLMD_EPP` names; `bench.lib.llmd`) with
  its default profile, or with its precise-prefix pipeline on the replicas' KV events plus its
  token-aware load; the same kube-apiserver discovery and Envoy wiring as `go-epp`. The replicas
  publish KV events for `llm-d-precise` (`PUBLISHING_ROUTERS`).
- `sglang-router`: sglang-router 0.3.2, `--policy cache_aware` with its defaults, `--host
  127.0.0.1` and its own `--prometheus-port`. The simulator serves no /server_info or
  /model_info, so the router finds no model path and downloads no tokenizer (it logs "No
  tokenizer_path or model_path found for model unknown"); its connections stay on loopback.

- `clairvoyant`: no router process. The simulator itself serves a front
  (`prefix-epp sim --clairvoyant-port`, `prefix_epp_sim.clairvoyant`) that sends each request to the
  replica with the least predicted TTFT from the replicas' TRUE caches and queues: a reference
  no real router can reach, not a competitor. Its CPU is the simulator's (router CPU shows 0).

Replicas: `prefix-epp sim` with one process for all replicas on consecutive ports. KV events
are on only for the routers in KV_EVENT_ROUTERS (the prefix-epp setups; replica i publishes on
tcp://127.0.0.1:E+i, replay on R+i) and off (`--no-kv-events`) for the others, which cannot use
them and should not pay the simulator's publishing CPU.

Real engines (`--backend vllm`, `bench.lib.vllm_backend`): the same setups in front of two `vllm
serve` processes on 127.0.0.2 and 127.0.0.3 (a `Pool` of their addresses, processes and KV-event
sockets, which they publish for every setup); `clairvoyant` has no counterpart there.

Every Envoy a setup starts writes an access log (`with_access_log`, ACCESS_LOG_FORMAT), which
`Router.access_log` names: per request, how long Envoy took from the request's first byte to the
upstream request (the picker's whole exchange where there is one), read into the run's summary as
`gateway_ms` (bench.lib.runner).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.lib import go_epp, llmd
from bench.lib.oracle import BLOCK_SIZE
from extproc.commands.envoy_config import build_config, render
from testkit.envoy import envoy_binary, plain_envoy_config
from testkit.procs import Proc, consecutive_free_ports, free_ports, prefix_epp, python_module, running, wait_for_port

ENVOY_POLICIES = {"random": "RANDOM", "round-robin": "ROUND_ROBIN", "least-request": "LEAST_REQUEST"}
ROUTERS = (*ENVOY_POLICIES, "prefix-epp", "prefix-epp-cache-aware", "prefix-epp-weighted", "prefix-epp-precise",
           "go-epp", *llmd.SETUPS, "sglang-router", "clairvoyant")
# The picker subscribes to KV events for these.
KV_EVENT_ROUTERS = frozenset({"prefix-epp", "prefix-epp-cache-aware", "prefix-epp-weighted", "prefix-epp-precise"})
# The replicas publish KV events for these setups (the prefix-epp ones and llm-d's precise profile).
PUBLISHING_ROUTERS = KV_EVENT_ROUTERS | {"llm-d-precise"}
# Like for like: whether the picker's ext_proc stream is TLS and whether the picker reads KV events.
PICKER_TRANSPORT = {"prefix-epp": (False, "subscribed, routes approximately"),
                    "prefix-epp-cache-aware": (False, "subscribed, routes approximately"),
                    "prefix-epp-weighted": (False, "subscribed, routes approximately"),
                    "prefix-epp-precise": (False, "routes on them"), "go-epp": (False, "none"),
                    "llm-d": (False, "none"), "llm-d-precise": (False, "routes on them")}
# What each prefix-epp setup adds to the picker's defaults (before any --picker-variant flags).
PICKER_FLAGS = {"prefix-epp-cache-aware": ("--scheduler", "cache-aware"),
                "prefix-epp-weighted": ("--scheduler", "weighted"),
                "prefix-epp-precise": ("--prefix-scorer", "precise")}


@dataclass(frozen=True)
class Router:
    name: str
    url: str  # base URL clients send /v1/... to
    procs: tuple[Proc, ...]  # the processes of this setup
    picker_metrics_url: str = ""  # prefix-epp's /metrics
    access_log: Path | None = None  # the Envoy setups' access log (ACCESS_LOG_FORMAT), one line per request


# Per request, in microseconds: Envoy's time from the request's first byte to the upstream request's
# first byte (the whole ext_proc exchange and the pick, for setups with a picker).
ACCESS_LOG_FORMAT = "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%\n"


@dataclass(frozen=True)
class Pool:
    """The replicas: their ip:port, and the processes hosting them (one simulator, or the engines)."""

    addresses: list[str]
    procs: tuple[Proc, ...]
    kv_events: list[str] = field(default_factory=list)  # per replica "tcp://events@tcp://replay" (events on)
    front: str = ""  # ip:port of the simulator's clairvoyant front (SimSettings.clairvoyant)



def dead(procs: Sequence[Proc]) -> list[str]:
    """'argv[0..1] exited with CODE' for each process that is no longer running."""
    return [f"{' '.join(p.args[:3])} exited with {p.popen.returncode}" for p in procs if not p.alive()]


@dataclass(frozen=True)
class SimSettings:
    replicas: int
    kv_cache_blocks: int
    time_scale: float = 1.0
    block_size: int = BLOCK_SIZE
    max_num_seqs: int = 256
    max_model_len: int = 32768
    kv_events: bool = False  # replicas publish KV events (ZeroMQ PUB + replay ROUTER per replica)
    clairvoyant: bool = False  # the simulator also serves its clairvoyant front
    sim_args: tuple[str, ...] = ()  # further `prefix-epp sim` flags (a cost profile, --tokenizer)
    picker_args: tuple[str, ...] = ()  # what the prefix-epp setups add for these replicas (--tokenizer)


@contextlib.contextmanager
def sim_replicas(tmp: Path, sim: SimSettings) -> Iterator[Pool]:
    """Start `sim.replicas` fresh (cold-cache) simulated replicas (publishing KV events if `sim.kv_events`)."""
    n = sim.replicas
    base = consecutive_free_ports(3 * n if sim.kv_events else n)  # HTTP, then events, then replay ports
    max_model_len = min(sim.max_model_len, sim.kv_cache_blocks * sim.block_size)
    args = prefix_epp("sim", "--replicas", str(sim.replicas), "--port", str(base),
                      "--time-scale", str(sim.time_scale), "--kv-cache-blocks", str(sim.kv_cache_blocks),
                      "--block-size", str(sim.block_size), "--max-num-seqs", str(sim.max_num_seqs),
                      "--max-model-len", str(max_model_len), "--log-level", "warning", *sim.sim_args)
    events: list[str] = []
    if sim.kv_events:
        pub, replay = base + n, base + 2 * n
        args += ["--kv-events", "--kv-events-port-base", str(pub), "--kv-events-replay-port-base", str(replay)]
        events = [f"tcp://127.0.0.1:{pub + i}@tcp://127.0.0.1:{replay + i}" for i in range(n)]
    else:
        args.append("--no-kv-events")
    front = 0
    if sim.clairvoyant:
        front = next(p for p in free_ports(4) if not base <= p < base + 3 * n)
        args += ["--clairvoyant-port", str(front)]
    with running(args, tmp / "sim.log", wait_port=base) as proc:
        for i in range(n):
            wait_for_port(base + i, proc=proc.popen)
        if front:
            wait_for_port(front, proc=proc.popen)
        yield Pool([f"127.0.0.1:{base + i}" for i in range(n)], (proc,), events, f"127.0.0.1:{front}" if front else "")


@contextlib.contextmanager
def _envoy(tmp: Path, name: str, config: dict[str, Any], listen: int) -> Iterator[tuple[Proc, Path]]:
    """Envoy running `config`, with its access log (`with_access_log`): (the process, the log)."""
    path = tmp / f"{name}.yaml"
    access_log = tmp / f"{name}.access.log"
    with_access_log(config, access_log)
    path.write_text(render(config))
    args = [envoy_binary(), "-c", str(path), "--concurrency", "1", "--log-level", "warning",
            "--base-id", str(listen)]
    with running(args, tmp / f"{name}.log", wait_port=listen) as proc:
        yield proc, access_log


def with_access_log(config: dict[str, Any], path: Path) -> None:
    """Every HTTP connection manager of `config` logs each request to `path` in ACCESS_LOG_FORMAT."""
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                if f["name"] == "envoy.filters.network.http_connection_manager":
                    f["typed_config"]["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                        "path": str(path), "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}}}}]


@contextlib.contextmanager
def envoy_lb(tmp: Path, name: str, backends: Sequence[str]) -> Iterator[Router]:
    listen, admin = free_ports(2)
    config = plain_envoy_config(listen, admin, list(backends))
    for cluster in config["static_resources"]["clusters"]:
        cluster["lb_policy"] = ENVOY_POLICIES[name]
    with _envoy(tmp, f"envoy-{name}", config, listen) as (envoy, access_log):
        yield Router(name, f"http://127.0.0.1:{listen}", (envoy,), access_log=access_log)


@contextlib.contextmanager
def prefix_epp_router(tmp: Path, backends: Sequence[str], picker_args: Sequence[str] = (),
                      name: str = "prefix-epp", picker_endpoints: Sequence[str] = ()) -> Iterator[Router]:
    """`picker_endpoints`: the picker's --endpoints entries (with KV-event addresses); default `backends`."""
    grpc_port, health_port, metrics_port, listen, admin = free_ports(5)
    args = prefix_epp("serve", "--endpoints", ",".join(picker_endpoints or backends), "--secure-serving=false",
                      "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
                      "--metrics-port", str(metrics_port), "--bind-address", "127.0.0.1",
                      "--log-level", "warning", *picker_args)
    with running(args, tmp / "picker.log", wait_port=grpc_port) as picker:
        wait_for_port(metrics_port)
        config = build_config(listen, f"127.0.0.1:{grpc_port}", admin, epp_tls=False, endpoints=tuple(backends))
        with _envoy(tmp, "envoy-prefix-epp", config, listen) as (envoy, access_log):
            yield Router(name, f"http://127.0.0.1:{listen}", (picker, envoy), f"http://127.0.0.1:{metrics_port}/metrics",
                         access_log)


@contextlib.contextmanager
def go_epp_router(tmp: Path, backends: Sequence[str]) -> Iterator[Router]:
    listen, admin = free_ports(2)
    # Plaintext ext_proc, as the prefix-epp and llm-d setups run (PICKER_TRANSPORT).
    with go_epp.go_epp(tmp, backends, ("--secure-serving=false",)) as (picker, grpc_port, metrics_url, _kube):
        config = go_epp.envoy_config(listen, grpc_port, admin, backends, tls=False)
        with _envoy(tmp, "envoy-go-epp", config, listen) as (envoy, access_log):
            yield Router("go-epp", f"http://127.0.0.1:{listen}", (picker, envoy), metrics_url, access_log)


@contextlib.contextmanager
def llmd_router(name: str, tmp: Path, backends: Sequence[str], kv_events: Sequence[str] = (),
                block_size: int = BLOCK_SIZE) -> Iterator[Router]:
    """llm-d's router (`bench.lib.llmd`): `llm-d` its default profile, `llm-d-precise` on KV events."""
    config = None
    if name == "llm-d-precise":
        if not kv_events:
            raise ValueError("llm-d-precise needs replicas that publish KV events")
        events, replay = llmd.ports_of(kv_events)
        config = llmd.precise_config(f"http://{backends[0]}", events, replay, block_size)
    listen, admin = free_ports(2)
    with llmd.llmd_epp(tmp, backends, config) as (picker, grpc_port, metrics_url, _kube):
        envoy = go_epp.envoy_config(listen, grpc_port, admin, backends, tls=False)
        with _envoy(tmp, f"envoy-{name}", envoy, listen) as (proxy, access_log):
            yield Router(name, f"http://127.0.0.1:{listen}", (picker, proxy), metrics_url, access_log)


def go_epp_available() -> str:
    """"" when the go-epp setup can run here, else why not (no Go toolchain and no cached binary)."""
    return go_epp.unavailable()


@contextlib.contextmanager
def sglang_router(tmp: Path, backends: Sequence[str]) -> Iterator[Router]:
    port, prometheus = free_ports(2)
    args = python_module("sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                         "--worker-urls", *(f"http://{b}" for b in backends), "--policy", "cache_aware",
                         "--prometheus-port", str(prometheus), "--prometheus-host", "127.0.0.1",
                         "--log-level", "warn")
    with running(args, tmp / "sglang-router.log", wait_port=port) as proc:
        yield Router("sglang-router", f"http://127.0.0.1:{port}", (proc,))


def picker_flags(name: str, replicas_publish_events: bool) -> tuple[str, ...]:
    """The flags a prefix-epp setup adds to the picker's defaults (the setup in docs/benchmarks.md names them)."""
    if name == "prefix-epp-precise":
        return PICKER_FLAGS[name]
    return (*PICKER_FLAGS.get(name, ()), *(("--kv-events",) if replicas_publish_events else ()))


def picker_setup(name: str, backends: Sequence[str], picker_args: Sequence[str] = (),
                 kv_events: Sequence[str] = ()) -> tuple[list[str], tuple[str, ...]]:
    """(--endpoints entries, extra flags) of the picker of prefix-epp setup `name`; `picker_args` come last."""
    endpoints = [f"{b}@{e}" for b, e in zip(backends, kv_events, strict=True)] if kv_events else []
    if name == "prefix-epp-precise" and not endpoints:
        raise ValueError("prefix-epp-precise needs replicas that publish KV events")
    return endpoints, (*picker_flags(name, bool(endpoints)), *picker_args)


def start(name: str, tmp: Path, backends: Sequence[str], picker_args: Sequence[str] = (),
          kv_events: Sequence[str] = (), front: str = "") -> contextlib.AbstractContextManager[Router]:
    """The router setup called `name` (one of ROUTERS) in front of `backends`.

    `kv_events`: per backend "tcp://events@tcp://replay" when the replicas publish KV events
    (`Pool.kv_events`); prefix-epp then subscribes with `--kv-events`, prefix-epp-precise needs them.
    `front`: the simulator's clairvoyant front (`Pool.front`), which the `clairvoyant` setup is.
    """
    if name in ENVOY_POLICIES:
        return envoy_lb(tmp, name, backends)
    if name in KV_EVENT_ROUTERS:
        endpoints, flags = picker_setup(name, backends, picker_args, kv_events)
        return prefix_epp_router(tmp, backends, flags, name, endpoints)
    if name == "clairvoyant":
        if not front:
            raise ValueError("clairvoyant needs the simulator's front (SimSettings.clairvoyant)")
        return contextlib.nullcontext(Router("clairvoyant", f"http://{front}", ()))
    if name == "sglang-router":
        return sglang_router(tmp, backends)
    if name == "go-epp":
        return go_epp_router(tmp, backends)
    if name in llmd.SETUPS:
        return llmd_router(name, tmp, backends, kv_events)
    raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
