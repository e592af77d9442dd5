"""The Kubernetes side of the Envoy Gateway rig (testkit/envoy_gateway.py): the API, CRDs, objects.

`Cluster(workdir, eg_version, namespace, release)` owns a `RealKube` (etcd + kube-apiserver), the
Envoy Gateway build of that version (`bench/peers/build.sh envoy-gateway VERSION`: the binary and
the CRDs of the same module), and does what the missing controllers and kubelet would:

- `install_chart(values)`: `helm install` of charts/prefix-epp with the admin kubeconfig; the
  values are written to a file as a user would (`helm_install` returns the failed process too);
- `create_pod` / `set_pod_ready`: Pod objects with the status a kubelet writes;
- `write_endpoint_slice(service, ips)`: the EndpointSlice the EndpointSlice controller writes for
  a Service (label kubernetes.io/service-name, every port with the Service port's name, protocol
  and target port number, addresses ready);
- `materialise_volumes`: the ConfigMaps and Secrets a pod mounts, written to local directories;
- `wait_envoy_deployment`, `wait_route_accepted`: Envoy Gateway's own output read back, for the
  Gateway the route attaches to (`gateway()`: the chart's own, or the existing one named in the
  values with `envoyGateway.gateway.create: false`).
"""

from __future__ import annotations

import base64
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from testkit import helm as tools
from testkit.k8s_objects import CHART
from testkit.kubeapi import BUILD_SCRIPT, CRD_DIR, BuildFailed, RealKube

Obj = dict[str, Any]
EG_NAMESPACE = "envoy-gateway-system"

_PLURALS = {"Gateway": ("gateway.networking.k8s.io/v1", "gateways"),
            "HTTPRoute": ("gateway.networking.k8s.io/v1", "httproutes"),
            "GatewayClass": ("gateway.networking.k8s.io/v1", "gatewayclasses"),
            "EnvoyExtensionPolicy": ("gateway.envoyproxy.io/v1alpha1", "envoyextensionpolicies"),
            "BackendTrafficPolicy": ("gateway.envoyproxy.io/v1alpha1", "backendtrafficpolicies"),
            "ClientTrafficPolicy": ("gateway.envoyproxy.io/v1alpha1", "clienttrafficpolicies"),
            "EnvoyProxy": ("gateway.envoyproxy.io/v1alpha1", "envoyproxies"),
            "BackendTLSPolicy": ("gateway.networking.k8s.io/v1", "backendtlspolicies"),
            "Backend": ("gateway.envoyproxy.io/v1alpha1", "backends")}


def eg_build(version: str) -> Path:
    """Directory of the Envoy Gateway binary and its crds/ for `version` (built once, cached)."""
    proc = subprocess.run(["bash", str(BUILD_SCRIPT), "envoy-gateway", version], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise BuildFailed(f"bench/peers/build.sh envoy-gateway {version} failed:\n{proc.stderr[-3000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def _path(api_version: str, kind: str, namespace: str | None, name: str = "") -> str:
    plural = _PLURALS[kind][1] if kind in _PLURALS else kind.lower() + "s"
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    ns = f"/namespaces/{namespace}" if namespace else ""
    return f"{base}{ns}/{plural}" + (f"/{name}" if name else "")


class Cluster:
    def __init__(self, workdir: Path, eg_version: str, namespace: str, release: str) -> None:
        self.dir = workdir
        self.namespace = namespace
        self.release = release
        self.fullname = f"{release}-prefix-epp"
        self.eg_dir = eg_build(eg_version)
        self.helm_bin, _ = tools.ensure_layer_tools()  # before the private namespace: it has no network
        self.kube = RealKube(workdir, service_accounts=((namespace, self.fullname),))
        self.admin_kubeconfig = workdir / "admin.kubeconfig"
        self.values: dict[str, Any] = {}

    def start(self) -> Cluster:
        self.kube.start()
        self.kube.write_kubeconfig(self.admin_kubeconfig)
        for ns in (EG_NAMESPACE, self.namespace):
            self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        self.apply_crds([*sorted((self.eg_dir / "crds").glob("*.yaml")), *sorted(CRD_DIR.glob("*.yaml"))])
        return self

    def close(self) -> None:
        self.kube.close()

    # -- raw objects ----------------------------------------------------------------------------
    def create(self, obj: Obj) -> Obj:
        meta = obj["metadata"]
        return self.kube.ok("POST", _path(obj["apiVersion"], obj["kind"], meta.get("namespace")), obj)

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Obj | None:
        status, doc = self.kube.request("GET", _path(api_version, kind, namespace, name))
        return doc if status == 200 else None

    def items(self, api_version: str, kind: str, namespace: str | None) -> list[Obj]:
        return list(self.kube.ok("GET", _path(api_version, kind, namespace)).get("items") or [])

    def apply_crds(self, files: list[Path], timeout: float = 60.0) -> None:
        """Create every CRD in `files` (multi-document YAML; created, never applied: some exceed
        the 256 KiB last-applied annotation) and wait until each is Established."""
        names = []
        for f in files:
            for crd in yaml.safe_load_all(f.read_text()):
                if not crd or crd.get("kind") != "CustomResourceDefinition":
                    continue
                self.kube.ok("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
                names.append(crd["metadata"]["name"])
        self.kube.wait_established(names, time.monotonic() + timeout)

    # -- credentials ----------------------------------------------------------------------------
    def token_for(self, namespace: str, name: str) -> str:
        return self.kube.token_for(namespace, name)

    def kubeconfig(self, path: Path, token: str) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        return self.kube.write_kubeconfig(path, token)

    def write_secret(self, namespace: str, name: str, directory: Path) -> Path:
        """The Secret's keys as files in `directory` (what a Secret volume holds)."""
        doc = self.kube.ok("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")
        directory.mkdir(parents=True, exist_ok=True)
        for key, value in (doc.get("data") or {}).items():
            (directory / key).write_bytes(base64.b64decode(value))
        return directory

    # -- the chart ------------------------------------------------------------------------------
    def helm_install(self, values: dict[str, Any], release: str | None = None) -> subprocess.CompletedProcess[str]:
        helm_bin = self.helm_bin
        home = self.dir / "helm-home"
        helm = tools.Helm(binary=helm_bin, home=home)
        home.mkdir(parents=True, exist_ok=True)
        path = home / f"values-{release or self.release}.yaml"
        path.write_text(yaml.safe_dump(values))
        env = {**helm.env, "KUBECONFIG": str(self.admin_kubeconfig)}
        return subprocess.run([str(helm_bin), "install", release or self.release, str(CHART), "--namespace",
                               self.namespace, "--values", str(path)], capture_output=True, text=True, env=env,
                              timeout=180, check=False)

    def install_chart(self, values: dict[str, Any]) -> None:
        proc = self.helm_install(values)
        if proc.returncode != 0:
            raise RuntimeError(f"helm install failed:\n{proc.stdout}\n{proc.stderr}")
        self.values = values

    def values_of(self, dotted: str) -> Any:
        node: Any = self.values
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def gateway(self) -> tuple[str, str]:
        """(namespace, name) of the Gateway the installed chart's route attaches to."""
        if self.values_of("envoyGateway.gateway.create") is False:
            return (self.values_of("envoyGateway.gateway.namespace") or self.namespace,
                    str(self.values_of("envoyGateway.gateway.name")))
        return self.namespace, str(self.values_of("envoyGateway.gateway.name") or f"{self.fullname}-gateway")

    def picker_deployment(self) -> Obj:
        return self.kube.ok("GET", f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.fullname}")

    def picker_service(self) -> Obj:
        return self.kube.ok("GET", f"/api/v1/namespaces/{self.namespace}/services/{self.fullname}")

    def model_service(self) -> Obj:
        services = self.items("v1", "Service", self.namespace)
        return next(s for s in services if s["metadata"]["name"].endswith("-models"))

    def service_hosts(self, pods: list[Any]) -> dict[str, str]:
        """In-cluster names of the picker Service, for the hosts file (no trailing dot)."""
        svc = f"{self.fullname}.{self.namespace}.svc"
        ip = pods[0].ip if pods else "127.0.0.1"
        return {f"{svc}.cluster.local": ip, svc: ip}

    def materialise_volumes(self, pod_spec: Obj, container: Obj, root: Path) -> dict[str, Path]:
        """{mountPath: local directory} holding each mounted ConfigMap or Secret (emptyDirs empty)."""
        volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
        out: dict[str, Path] = {}
        for mount in container.get("volumeMounts") or []:
            vol = volumes[mount["name"]]
            local = root / "mounts" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            if "configMap" in vol or "secret" in vol:
                source = vol.get("configMap") or vol["secret"]
                kind = "configmaps" if "configMap" in vol else "secrets"
                name = source.get("name") or source.get("secretName")
                doc = self.kube.ok("GET", f"/api/v1/namespaces/{self.namespace}/{kind}/{name}")
                data = {k: (v.encode() if kind == "configmaps" else base64.b64decode(v))
                        for k, v in (doc.get("data") or {}).items()}
                items = source.get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    (local / item["path"]).write_bytes(data[item["key"]])
            out[mount["mountPath"].rstrip("/")] = local
        return out

    # -- what controllers and kubelets would write ----------------------------------------------
    def create_pod(self, name: str, labels: dict[str, str], ip: str, ready: bool = True) -> Obj:
        return self.kube.create_pod(name, labels, ip=ip, ready=ready, namespace=self.namespace)

    def delete_pod(self, name: str) -> None:
        self.kube.request("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{name}?gracePeriodSeconds=0")

    def pre_stop_sleep(self) -> float:
        """Seconds of the picker container's preStop sleep (0 without one)."""
        container = self.picker_deployment()["spec"]["template"]["spec"]["containers"][0]
        command = (((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command")
        return float(command[1]) if command and command[0] == "sleep" else 0.0

    def set_pod_ready(self, name: str, ip: str, ready: bool) -> Obj:
        return self.kube.set_pod_status(name, ip, ready, namespace=self.namespace)

    def write_endpoint_slice(self, service: Obj, ips: list[str]) -> None:
        name = service["metadata"]["name"]
        ports = []
        for p in service["spec"]["ports"]:
            port: Obj = {"name": p.get("name", ""), "protocol": p.get("protocol", "TCP"),
                         "port": self._target_port(service, p)}
            if p.get("appProtocol"):
                port["appProtocol"] = p["appProtocol"]
            ports.append(port)
        body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                "metadata": {"name": f"{name}-rig", "namespace": self.namespace,
                             "labels": {"kubernetes.io/service-name": name,
                                        "endpointslice.kubernetes.io/managed-by": "rig.prefix-epp.local"}},
                "ports": ports,
                "endpoints": [{"addresses": [ip], "conditions": {"ready": True, "serving": True,
                                                                  "terminating": False}} for ip in ips]}
        path = f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"
        status, _ = self.kube.request("PUT", f"{path}/{name}-rig", body)
        if status == 404:
            self.kube.ok("POST", path, body)
        elif status >= 300:
            raise RuntimeError(f"EndpointSlice {name}: HTTP {status}")

    def _target_port(self, service: Obj, port: Obj) -> int:
        target = port.get("targetPort", port["port"])
        if isinstance(target, int):
            return target
        deployment = self.picker_deployment()  # a named target port: only the picker's Service has them
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            for cp in c.get("ports") or []:
                if cp.get("name") == target:
                    return int(cp["containerPort"])
        raise KeyError(f"{service['metadata']['name']}: no container port named {target}")

    # -- Envoy Gateway's output -----------------------------------------------------------------
    def wait_envoy_deployment(self, timeout: float) -> Obj:
        deadline = time.monotonic() + timeout
        while True:
            items = self.items("apps/v1", "Deployment", EG_NAMESPACE)
            for d in items:
                labels = d["metadata"].get("labels") or {}
                if labels.get("gateway.envoyproxy.io/owning-gateway-namespace") == self.gateway()[0]:
                    return d
            if time.monotonic() > deadline:
                raise TimeoutError(f"Envoy Gateway wrote no Envoy Deployment in {timeout}s")
            time.sleep(0.2)

    def conditions(self, kind: str, name: str, namespace: str | None = None) -> dict[str, str]:
        api = _PLURALS[kind][0]
        doc = self.get(api, kind, namespace or self.namespace, name) or {}
        status = doc.get("status") or {}
        conds = status.get("conditions")
        if conds is None and status.get("parents"):
            conds = status["parents"][0].get("conditions")
        if conds is None and status.get("ancestors"):
            conds = status["ancestors"][0].get("conditions")
        return {c["type"]: c["status"] for c in conds or []}

    def wait_route_accepted(self, timeout: float) -> None:
        (gateway_ns, gateway), route = self.gateway(), f"{self.fullname}"
        deadline = time.monotonic() + timeout
        while True:
            gw = self.conditions("Gateway", gateway, gateway_ns)
            routes = self.items("gateway.networking.k8s.io/v1", "HTTPRoute", self.namespace)
            rc = self.conditions("HTTPRoute", routes[0]["metadata"]["name"]) if routes else {}
            if gw.get("Accepted") == "True" and rc.get("Accepted") == "True" and rc.get("ResolvedRefs") == "True":
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"Gateway {gateway} {gw}, HTTPRoute {route} {rc}")
            time.sleep(0.2)
