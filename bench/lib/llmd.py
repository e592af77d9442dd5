"""llm-d's router (`llm-d/llm-d-router`, `cmd/epp`) in front of the replicas: `llm-d` and `llm-d-precise`.

The binary is the one `LLMD_EPP=/path/to/epp` names; it is built outside the repository from
llm-d's published source (the README says how the measured one was built) and none of its code
lives here. Without it the benchmark reports both setups as not run, and why (`unavailable`).
A `BUILD-INFO` file beside the binary (`key: value` lines), when there is one, is copied into the
results (`build_info`).

A setup, the same discovery as `bench.lib.go_epp` (llm-d's router is the Inference Extension's
picker grown on):
1. a real etcd + kube-apiserver (`testkit.kubeapi.RealKube`) with the InferencePool CRD
   (inference.networking.k8s.io/v1); llm-d's own InferenceObjective / InferenceModelRewrite
   CRDs are absent, which the router logs and skips;
2. the InferencePool `bench` over the replicas' ports and one Ready pod per replica
   (`go_epp.pool_objects`): pod i serves port i of the pool's `targetPorts`, so llm-d gives it
   rank index i, which is what it adds to the KV-event socket port (vLLM's data-parallel port
   offsetting): replica i's events at tcp://127.0.0.1:(E + i), replay at R + i, exactly where the
   simulator publishes them (`bench.lib.routers.sim_replicas`);
3. the router with `--secure-serving=false` (plaintext ext_proc, as the prefix-epp setups run;
   the table's TLS column says so), `--health-checking`, `--metrics-endpoint-auth=false`,
   `--tracing=false`, and:
   - `llm-d`: no `--config-file`, i.e. its built-in default profile (v0.10.0
     `pkg/epp/config/loader/defaults.go`: queue-scorer 2, kv-cache-utilization-scorer 2,
     prefix-cache-scorer 3 over the approximate prefix producer, max-score picker, vLLM metrics
     scraped from each endpoint);
   - `llm-d-precise`: `precise_config`, the precise-prefix pipeline of llm-d's
     `deploy/config/epp-precise-prefix-cache-config.yaml` (token-producer over vLLM's render
     routes -> precise-prefix-cache-producer fed by the replicas' KV events -> prefix-cache-scorer)
     with the token-aware load of the plugins' READMEs: inflight-load-producer, the
     prefix-cache-affinity-filter (sticky until the in-flight token gate opens) and the
     token-load-scorer in place of the queue scorer. The token producer renders through replica
     0's `/v1/completions/render` and `/v1/chat/completions/render` (the simulator serves them, as
     vLLM does); a router that cannot render silently falls back to an estimate and scores no hits;
4. Envoy with the reference ext_proc settings (`go_epp.envoy_config`, plaintext to the picker).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from bench.lib import go_epp
from testkit.kubeapi import RealKube, built
from testkit.procs import Proc, free_ports, running, wait_for_port

ENV = "LLMD_EPP"
SETUPS = ("llm-d", "llm-d-precise")
MODEL = "sim-model"  # the base model name the bench's requests and the simulator's topic carry


def binary() -> Path | None:
    path = os.environ.get(ENV, "")
    return Path(path) if path else None


def unavailable() -> str:
    """"" when llm-d's router and the API server can run here, else why not."""
    path = binary()
    if path is None:
        return (f"{ENV} is not set: point it at an llm-d router binary (llm-d-router cmd/epp, built outside "
                "this repository)")
    if not (path.is_file() and os.access(path, os.X_OK)):
        return f"{ENV}={path} is not an executable file"
    return go_epp.unavailable()


def build_info() -> dict[str, str]:
    """BUILD-INFO beside the binary (`key: value` lines), else the binary's path alone."""
    path = binary()
    assert path is not None
    info = path.parent / "BUILD-INFO"
    out = {"binary": str(path)}
    if info.is_file():
        out |= dict(line.split(": ", 1) for line in info.read_text().splitlines() if ": " in line)
    return out


def ports_of(kv_events: Sequence[str]) -> tuple[int, int]:
    """(events port, replay port) of replica 0 from `Pool.kv_events` ("tcp://h:E@tcp://h:R"),
    checked to be consecutive per replica, as llm-d's rank offsetting needs."""
    pairs = []
    for spec in kv_events:
        events, replay = spec.split("@", 1)
        pairs.append((int(events.rsplit(":", 1)[1]), int(replay.rsplit(":", 1)[1])))
    for i, (e, r) in enumerate(pairs):
        if (e, r) != (pairs[0][0] + i, pairs[0][1] + i):
            raise ValueError(f"replica {i} publishes on {e}/{r}: llm-d needs consecutive ports from "
                             f"{pairs[0][0]}/{pairs[0][1]}")
    return pairs[0]


def precise_config(render_url: str, events_port: int, replay_port: int, block_size: int,
                   model: str = MODEL) -> dict[str, Any]:
    """The `llm-d-precise` EndpointPickerConfig (module docstring, 3.). Every consumer of prefix
    matches names the precise producer: one that names none reads an approximate producer that
    llm-d spawns on its own."""
    precise = "precise-prefix-cache-producer"
    plugins: list[dict[str, Any]] = [
        {"type": "token-producer", "parameters": {"modelName": model, "vllm": {"url": render_url}}},
        {"type": "endpoint-notification-source"},
        {"type": "metrics-data-source"},
        {"type": "core-metrics-extractor"},
        {"type": "precise-prefix-cache-producer", "parameters": {
            "tokenProcessorConfig": {"blockSizeTokens": block_size},
            "indexerConfig": {"kvBlockIndexConfig": {"enableMetrics": True}},  # as llm-d's sample config
            "kvEventsConfig": {"topicFilter": "kv@", "discoverPods": True,
                               "podDiscoveryConfig": {"socketPort": events_port, "replaySocketPort": replay_port}}}},
        {"type": "inflight-load-producer", "parameters": {"prefixMatchInfoProducerName": precise}},
        {"type": "prefix-cache-scorer", "parameters": {"prefixMatchInfoProducerName": precise}},
        {"type": "prefix-cache-affinity-filter", "parameters": {"prefixMatchInfoProducerName": precise}},
        {"type": "token-load-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "max-score-picker"},
    ]
    return {
        "apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig", "plugins": plugins,
        "dataLayer": {"sources": [
            {"pluginRef": "metrics-data-source", "extractors": [{"pluginRef": "core-metrics-extractor"}]},
            {"pluginRef": "endpoint-notification-source",
             "extractors": [{"pluginRef": "precise-prefix-cache-producer"}]}]},
        "schedulingProfiles": [{"name": "default", "plugins": [
            {"pluginRef": "prefix-cache-affinity-filter"},
            {"pluginRef": "prefix-cache-scorer", "weight": 2},
            {"pluginRef": "token-load-scorer", "weight": 1},
            {"pluginRef": "kv-cache-utilization-scorer", "weight": 1},
            {"pluginRef": "max-score-picker"}]}],
    }


@contextlib.contextmanager
def llmd_epp(tmp: Path, backends: Sequence[str], config: dict[str, Any] | None = None,
             timeout: float = 90.0) -> Iterator[tuple[Proc, int, str, RealKube]]:
    """(router process, ext_proc port, /metrics URL, API) with the pool synced to all `backends`."""
    path = binary()
    if path is None:
        raise RuntimeError(unavailable())
    built("kube")  # the API server's binaries (bench/peers/build.sh kube), before the clock starts
    with contextlib.ExitStack() as stack:
        kube = RealKube(tmp / "kube")
        stack.callback(kube.close)
        kube.start()
        kube.apply_crds()
        go_epp.pool_objects(kube, backends)
        kubeconfig = kube.write_kubeconfig(tmp / "kubeconfig")
        grpc_port, health_port, metrics_port = free_ports(3)
        args = [str(path), "--pool-name", go_epp.POOL, "--pool-namespace", go_epp.NAMESPACE,
                "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
                "--metrics-port", str(metrics_port), "--secure-serving=false", "--health-checking",
                "--metrics-endpoint-auth=false", "--tracing=false", "--v", "1", "--zap-encoder", "json"]
        if config is not None:
            config_path = tmp / "llm-d-config.yaml"
            config_path.write_text(yaml.safe_dump(config, sort_keys=False))
            args += ["--config-file", str(config_path)]
        picker = stack.enter_context(running(args, tmp / "llm-d.log", env={"KUBECONFIG": str(kubeconfig)},
                                             wait_port=grpc_port, timeout=timeout))
        wait_for_port(metrics_port, proc=picker.popen)
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        deadline = time.monotonic() + timeout
        # Ready, and every endpoint scraped once (its ready-pods gauge counts endpoints with fresh metrics).
        while not go_epp.serving(health_port) or go_epp.ready_endpoints(metrics_url) < len(backends):
            if not picker.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"llm-d did not become ready over {len(backends)} endpoints:\n"
                                   f"{picker.log_text()[-3000:]}")
            time.sleep(0.1)
        yield picker, grpc_port, metrics_url, kube
