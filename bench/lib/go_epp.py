"""The Go endpoint picker (Gateway API Inference Extension v1.5.0, `cmd/epp`) in front of simulated replicas.

The picker is the binary `bench/peers/build.sh gie-epp` builds (cached outside the repository).
It has no static or file discovery: it reads its InferencePool and the pool's Pods from a
Kubernetes API. So a setup here is:

1. a real etcd + kube-apiserver on 127.0.0.1 (`testkit.kubeapi.RealKube`), with the
   upstream v1.5.0 CRDs (InferencePool, InferenceObjective, InferenceModelRewrite) installed;
2. an InferencePool `bench` whose `targetPorts` are the replicas' ports, and one Pod per replica
   (podIP 127.0.0.1, Ready), each carrying the `inference.networking.k8s.io/active-ports`
   annotation with its replica's port, so pod i is exactly endpoint 127.0.0.1:port_i. The picker
   scrapes each endpoint's /metrics on that port (the simulator speaks vLLM's metric names);
3. the picker with its documented defaults: no `--config-file`, i.e. the built-in profile
   (queue-scorer weight 2, kv-cache-utilization-scorer 2, prefix-cache-scorer 3 with
   approximate prefix indexing, max-score-picker), secure serving on (self-signed TLS), health
   checking on the ext_proc port; only `--metrics-endpoint-auth=false` (we read its /metrics
   without a token) and `--tracing=false` (no collector here) change;
4. Envoy with the Inference Extension's reference ext_proc settings (GIE `test/testdata/envoy.yaml`):
   request and response bodies FULL_DUPLEX_STREAMED (the only body mode the Go picker supports),
   trailers SEND, TLS to the picker without verification, gRPC health check on the ext_proc
   service; built by the same `extproc.commands.envoy_config.build_config` as prefix-epp's (which runs with
   its own defaults), with the same override_host cluster of the replicas (`envoy_config`).
The picker listens on all interfaces (it has no bind-address flag); all traffic is loopback.
Its admission, with no InferenceObjective, never sheds (priority 0).

The precise-prefix profile lives in llm-d's router, not in GIE v1.5.0, so there is no
`go-epp-precise` setup.
"""

from __future__ import annotations

import contextlib
import shutil
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from extproc.commands.envoy_config import build_config
from extproc.core.datastore import split_host_port
from extproc.pb import health_pb2, health_pb2_grpc
from testkit.kubeapi import RealKube, built
from testkit.procs import Proc, free_ports, running, wait_for_port
from testkit.user_cache import cache_dir

POOL = "bench"
NAMESPACE = "default"


def envoy_config(listen: int, grpc_port: int, admin: int, backends: Sequence[str],
                 tls: bool = True) -> dict[str, Any]:
    """Envoy in front of the Go picker on `grpc_port`, with the reference ext_proc modes."""
    return build_config(listen, f"127.0.0.1:{grpc_port}", admin, epp_tls=tls,
                        request_body_mode="FULL_DUPLEX_STREAMED", response_processing="full-duplex",
                        endpoints=tuple(backends))


def binary() -> Path:
    return built("gie-epp") / "epp"


def pool_objects(kube: RealKube, backends: Sequence[str]) -> None:
    """The InferencePool over `backends` (ip:port) and one Ready pod per backend."""
    ports = [split_host_port(b)[1] for b in backends]
    kube.ok("POST", f"/apis/inference.networking.k8s.io/v1/namespaces/{NAMESPACE}/inferencepools", {
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": POOL, "namespace": NAMESPACE},
        "spec": {"selector": {"matchLabels": {"app": "sim"}}, "targetPorts": [{"number": p} for p in ports],
                 "endpointPickerRef": {"name": "go-epp", "port": {"number": 9002}}}})  # required by the CRD
    for i, backend in enumerate(backends):
        host, port = split_host_port(backend)
        kube.create_pod(f"sim-{i}", {"app": "sim"}, ip=host,
                        annotations={"inference.networking.k8s.io/active-ports": str(port)})


def ready_endpoints(metrics_url: str) -> float:
    """`inference_pool_ready_pods` from the picker's /metrics (0 until it has synced)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("inference_pool_ready_pods{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def serving(health_port: int) -> bool:
    """The picker's gRPC readiness (SERVING once its InferencePool is synced)."""
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="readiness"),
                                                        timeout=2.0)
        except grpc.RpcError:
            return False
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


@contextlib.contextmanager
def go_epp(tmp: Path, backends: Sequence[str], extra_args: Sequence[str] = (),
           timeout: float = 60.0) -> Iterator[tuple[Proc, int, str, RealKube]]:
    """(picker process, ext_proc port, /metrics URL, API) with the pool synced to all `backends`.

    `extra_args` are added to the picker's flags (bench/overhead.py: plaintext, no scraping).
    """
    with contextlib.ExitStack() as stack:
        kube = RealKube(tmp / "kube")
        stack.callback(kube.close)
        kube.start()
        kube.apply_crds()
        pool_objects(kube, backends)
        kubeconfig = kube.write_kubeconfig(tmp / "kubeconfig")
        grpc_port, health_port, metrics_port = free_ports(3)
        args = [str(binary()), "--pool-name", POOL, "--pool-namespace", NAMESPACE,
                "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
                "--metrics-port", str(metrics_port), "--health-checking", "--metrics-endpoint-auth=false",
                "--tracing=false", "--v", "1", "--zap-encoder", "json", *extra_args]
        picker = stack.enter_context(running(args, tmp / "go-epp.log", env={"KUBECONFIG": str(kubeconfig)},
                                             wait_port=grpc_port, timeout=timeout))
        wait_for_port(metrics_port, proc=picker.popen)
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        deadline = time.monotonic() + timeout
        # Its ready-pods gauge counts only endpoints with fresh metrics: with scraping off, the
        # caller waits for a routed request instead (the pool itself is synced at readiness).
        scraping = "--refresh-metrics-interval" not in extra_args
        while ready_endpoints(metrics_url) < len(backends) if scraping else not serving(health_port):
            if not picker.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"go-epp did not sync {len(backends)} endpoints:\n{picker.log_text()[-3000:]}")
            time.sleep(0.1)
        yield picker, grpc_port, metrics_url, kube


def build_info() -> dict[str, str]:
    """The BUILD-INFO of the picker binary in use (version, module sum, Go version), for results files."""
    info = (binary().parent / "BUILD-INFO").read_text()
    out = dict(line.split(": ", 1) for line in info.splitlines() if ": " in line)
    out["module"] = next((line.strip() for line in info.splitlines() if line.startswith("sigs.k8s.io/")), "")
    return out


def unavailable() -> str:
    """"" when the Go picker and the API server can be used here (cached, or Go to build them), else why not."""
    cached = all((cache_dir() / target).is_dir() and any((cache_dir() / target).glob("*/BUILD-INFO"))
                 for target in ("gie-epp", "kube"))
    if cached or shutil.which("go") or Path("/usr/local/go/bin/go").exists():
        return ""
    return "no Go toolchain to build the Go endpoint picker and kube-apiserver (bench/peers/build.sh)"


