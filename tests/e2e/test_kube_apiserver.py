"""Discovery against a real Kubernetes API: etcd + kube-apiserver built from source (testkit/kubeapi.py).

What kmock cannot show (tests/e2e/test_kubernetes_discovery.py runs the same picker against kmock):
- the InferencePool CRDs are installed from the vendored upstream YAML (testkit/crds/apiserver/gie-v1.5.0)
  and their schema is enforced by the server;
- label selectors are applied by the server, and the picker's pod LIST/WATCH send them;
- the picker's watch loop (extproc/discovery/watch.py, `ListWatch`) resumes from its last
  resourceVersion across watch restarts (no relist, no duplicate ADDED), handles the watch cache's
  BOOKMARK events, and after etcd compaction gets 410 Gone and relists;
- the Helm chart's Role and RoleBinding, applied with kubectl, are exactly enough: the picker runs
  as that ServiceAccount and becomes ready, and every other verb/resource/namespace is forbidden.
The API server runs once per module; each test uses its own namespace.
"""

from __future__ import annotations

import itertools
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from operator import contains
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
import urllib3
from kubernetes import client as k8s_client

from extproc.discovery.watch import Backoff, ListResult, ListWatch
from extproc.pb import health_pb2, health_pb2_grpc
from testkit import helm as tools
from testkit.envoy import wait_until
from testkit.k8s_objects import CHART, with_image
from testkit.kubeapi import BuildFailed, RealKube
from testkit.procs import free_ports, prefix_epp, running, wait_for_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]  # the first run builds kube-apiserver and etcd
RELEASE = "epp"
SA_NAMESPACE = "rbac"
_ns_counter = itertools.count()


def _rendered_rbac(tmp: Path) -> list[dict[str, Any]]:
    helm_bin, _ = tools.ensure_layer_tools()
    (tmp / "helm-home").mkdir(exist_ok=True)
    helm = tools.Helm(binary=helm_bin, home=tmp / "helm-home")
    docs = helm.template(CHART, release=RELEASE, namespace=SA_NAMESPACE,
                         values=with_image({"inferencePool": {"name": "pool"}}))
    return [d for d in docs if d["kind"] in ("Role", "RoleBinding", "ServiceAccount")]


@pytest.fixture(scope="module")
def rbac_objects(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _rendered_rbac(tmp_path_factory.mktemp("helm"))


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory, rbac_objects: list[dict[str, Any]]) -> Iterator[RealKube]:
    binding = next(d for d in rbac_objects if d["kind"] == "RoleBinding")
    subject = binding["subjects"][0]
    accounts = ((subject["namespace"], subject["name"]),)
    try:
        api = RealKube(tmp_path_factory.mktemp("kube"), service_accounts=accounts)
    except BuildFailed as exc:
        pytest.fail(str(exc))
    try:
        api.start()
        api.apply_crds()
        yield api
    finally:
        api.close()


def namespace(kube: RealKube) -> str:
    name = f"t{next(_ns_counter)}-{int(time.time() * 1000) % 100000}"
    kube.ok("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name


def api_client(kube: RealKube, token: str | None = None) -> k8s_client.ApiClient:
    cfg = k8s_client.Configuration()
    cfg.host = kube.url
    cfg.ssl_ca_cert = str(kube.dir / "ca.crt")
    cfg.api_key = {"authorization": token or kube.tokens["admin"]}
    cfg.api_key_prefix = {"authorization": "Bearer"}
    return k8s_client.ApiClient(cfg)


def pool(name: str, ns: str, selector: dict[str, str], ports: list[int]) -> dict[str, Any]:
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"selector": {"matchLabels": selector}, "targetPorts": [{"number": p} for p in ports],
                     "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}}


until = partial(wait_until, timeout=15.0, interval=0.02)


def watch_lines(kube: RealKube, path: str, timeout_s: int) -> tuple[int, list[dict[str, Any]]]:
    """(HTTP status, events) of one watch request read to its end (server-side timeout)."""
    http = urllib3.PoolManager(ca_certs=str(kube.dir / "ca.crt"))
    resp = http.request("GET", kube.url + path, headers={"authorization": f"Bearer {kube.tokens['admin']}"},
                        preload_content=True, timeout=timeout_s + 10)
    if resp.status != 200:
        return resp.status, [orjson.loads(resp.data)]
    return 200, [orjson.loads(line) for line in resp.data.splitlines() if line.strip()]


# -- CRDs and selectors --------------------------------------------------------------------------------

def test_vendored_crds_are_served_and_their_schema_enforced(kube: RealKube) -> None:
    ns = namespace(kube)
    base = f"/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools"
    created = kube.ok("POST", base, pool("p", ns, {"app": "vllm"}, [8000]))
    assert created["spec"]["targetPorts"] == [{"number": 8000}]
    assert created["spec"].get("appProtocol", "http") == "http"
    good = pool("bad", ns, {"app": "x"}, [8000])["spec"]
    for bad in ({**good, "targetPorts": []},  # 1..8 ports
                {**good, "targetPorts": [{"number": 70000}]},
                {k: v for k, v in good.items() if k != "selector"},
                {k: v for k, v in good.items() if k != "endpointPickerRef"}):  # required in the v1.5.0 schema
        status, doc = kube.request("POST", base, {"apiVersion": "inference.networking.k8s.io/v1",
                                                  "kind": "InferencePool",
                                                  "metadata": {"name": "bad", "namespace": ns}, "spec": bad})
        assert status == 422, (bad, status, doc)
    objectives = f"/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{ns}/inferenceobjectives"
    assert kube.request("GET", objectives)[0] == 200


def test_label_selector_is_applied_by_the_server(kube: RealKube) -> None:
    ns = namespace(kube)
    kube.create_pod("a", {"app": "vllm"}, namespace=ns)
    kube.create_pod("b", {"app": "other"}, namespace=ns)
    names = [p["metadata"]["name"] for p in kube.ok("GET", f"/api/v1/namespaces/{ns}/pods?labelSelector=app%3Dvllm")
             ["items"]]
    assert names == ["a"]
    # The picker's own pod LIST passes the selector through (nothing filtered client-side here).
    seen: list[ListResult] = []
    core = k8s_client.CoreV1Api(api_client(kube))
    lw = ListWatch("pods", core.list_namespaced_pod, (ns,), seen.append, lambda *_: None,
                   query=lambda: {"label_selector": "app=vllm"}, watch_timeout_s=5)
    lw.start()
    try:
        until(lambda: bool(seen), what="first list")
        assert [p["metadata"]["name"] for p in seen[0].items] == ["a"]
    finally:
        lw.stop()
        lw.join(5)


# -- watch: resume, bookmarks, 410 -------------------------------------------------------------------

class Gate:
    """Wraps a list function: while closed, WATCH calls wait (the LIST/WATCH themselves stay real)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.open = threading.Event()
        self.open.set()
        self.waiting = threading.Event()
        self.watch_rvs: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("watch"):
            self.watch_rvs.append(str(kwargs.get("resource_version", "")))
            if not self.open.is_set():
                self.waiting.set()
                self.open.wait(30)
        return self.fn(*args, **kwargs)


class Recorder:
    def __init__(self) -> None:
        self.lists: list[set[str]] = []
        self.events: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def on_list(self, result: ListResult) -> None:
        with self.lock:
            self.lists.append({p["metadata"]["name"] for p in result.items})

    def on_event(self, kind: str, obj: dict[str, Any]) -> None:
        with self.lock:
            self.events.append((kind, obj["metadata"]["name"]))


def pods_watch(kube: RealKube, ns: str, timeout_s: float = 1.0) -> tuple[ListWatch, Gate, Recorder]:
    gate = Gate(k8s_client.CoreV1Api(api_client(kube)).list_namespaced_pod)
    rec = Recorder()
    lw = ListWatch("pods", gate, (ns,), rec.on_list, rec.on_event, query=lambda: {"label_selector": "app=vllm"},
                   watch_timeout_s=timeout_s, backoff=Backoff(0.05, 0.2))
    lw.start()
    until(lambda: bool(rec.lists), what="first list")
    return lw, gate, rec


def hold_next_watch(gate: Gate) -> None:
    """Let the open watch end by its server timeout; the next WATCH waits until `gate.open` is set."""
    gate.waiting.clear()
    gate.open.clear()
    until(gate.waiting.is_set, timeout=10, what="watch restart")


def test_watch_resumes_from_resource_version_without_relisting(kube: RealKube) -> None:
    ns = namespace(kube)
    kube.create_pod("a", {"app": "vllm"}, namespace=ns)
    lw, gate, rec = pods_watch(kube, ns)
    try:
        assert rec.lists == [{"a"}]
        for i in range(3):  # changes made while no watch is open arrive when it resumes
            hold_next_watch(gate)
            kube.create_pod(f"n{i}", {"app": "vllm"}, namespace=ns)
            kube.ok("DELETE", f"/api/v1/namespaces/{ns}/pods/{'a' if i == 0 else f'n{i - 1}'}")
            gate.open.set()
            until(partial(contains, rec.events, ("ADDED", f"n{i}")), what=f"ADDED n{i}")
        until(lambda: ("DELETED", "n1") in rec.events, what="DELETED n1")
        assert lw.lists == 1 and len(rec.lists) == 1  # never relisted
        # A real server replays nothing twice (kmock replays every object on each watch).
        assert [name for kind, name in rec.events if kind == "ADDED"] == ["n0", "n1", "n2"]
        assert {name for kind, name in rec.events if kind == "DELETED"} == {"a", "n0", "n1"}
        assert all(rv for rv in gate.watch_rvs)  # every watch resumed from a resourceVersion
        assert len(set(gate.watch_rvs)) >= 3
    finally:
        gate.open.set()
        lw.stop()
        lw.join(5)


def test_watch_after_etcd_compaction_gets_410_and_relists(kube: RealKube) -> None:
    ns = namespace(kube)
    kube.create_pod("a", {"app": "vllm"}, namespace=ns)
    kube.create_pod("b", {"app": "vllm"}, namespace=ns)
    # The server side first: a watch from a compacted resourceVersion is 410 Gone.
    rv0 = kube.ok("GET", f"/api/v1/namespaces/{ns}/pods")["metadata"]["resourceVersion"]
    kube.create_pod("c", {"app": "other"}, namespace=ns)
    kube.compact()
    status, events = watch_lines(kube, f"/api/v1/namespaces/{ns}/pods?watch=1&resourceVersion={rv0}"
                                       "&timeoutSeconds=2", 2)
    codes = [status] + [e.get("object", {}).get("code") for e in events if e.get("type") == "ERROR"]
    assert 410 in codes, (status, events)
    # The picker's loop: its resume point is compacted away while it is not watching.
    lw, gate, rec = pods_watch(kube, ns)
    try:
        assert rec.lists == [{"a", "b"}]
        hold_next_watch(gate)
        kube.ok("DELETE", f"/api/v1/namespaces/{ns}/pods/a")
        kube.create_pod("d", {"app": "vllm"}, namespace=ns)
        kube.compact()
        gate.open.set()
        until(lambda: len(rec.lists) == 2, what="relist after 410")
        assert rec.lists[1] == {"b", "d"}
        assert lw.lists == 2
        kube.create_pod("e", {"app": "vllm"}, namespace=ns)  # and it watches on from the new list
        until(lambda: ("ADDED", "e") in rec.events, what="ADDED e after relist")
    finally:
        gate.open.set()
        lw.stop()
        lw.join(5)


def test_watch_cache_bookmarks_become_the_loops_resume_point(kube: RealKube) -> None:
    """The watch cache sends BOOKMARKs; the loop resumes from a bookmark's resourceVersion.

    A plain watch gets its periodic bookmark only about once a minute, so the deterministic one is
    used here: a streaming list (`sendInitialEvents=true`, resourceVersionMatch NotOlderThan) ends
    its initial events with a BOOKMARK carrying the cache's current resourceVersion, which moved
    past every object of this namespace (a change happened in another namespace meanwhile).
    """
    ns, elsewhere = namespace(kube), namespace(kube)
    pools = f"/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools"
    kube.ok("POST", pools, pool("p", ns, {"app": "vllm"}, [8000]))
    status, events = watch_lines(kube, f"{pools}?watch=1&allowWatchBookmarks=true&sendInitialEvents=true"
                                       "&resourceVersionMatch=NotOlderThan&timeoutSeconds=2", 2)
    assert status == 200 and [e["type"] for e in events] == ["ADDED", "BOOKMARK"], events
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}

    def configmap(name: str, where: str) -> dict[str, Any]:
        return kube.ok("POST", f"/api/v1/namespaces/{where}/configmaps",
                       {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}})

    mine = configmap("c1", ns)
    core = k8s_client.CoreV1Api(api_client(kube))

    def streaming(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("watch"):
            kwargs.update(send_initial_events=True, resource_version_match="NotOlderThan")
        return core.list_namespaced_config_map(*args, **kwargs)

    gate = Gate(streaming)
    gate.open.clear()  # hold the first watch until the list is done and the cache has moved on
    rec = Recorder()
    lw = ListWatch("configmaps", gate, (ns,), rec.on_list, rec.on_event, watch_timeout_s=1)
    lw.start()
    try:
        until(gate.waiting.is_set, what="first watch")
        moved = configmap("elsewhere", elsewhere)["metadata"]["resourceVersion"]
        gate.open.set()
        until(lambda: len(gate.watch_rvs) >= 2, timeout=20, what="second watch")
        # Each streaming watch replays c1 as ADDED, then the bookmark: no relist, no other event.
        assert lw.lists == 1 and set(rec.events) == {("ADDED", "c1")}
        resumed = int(gate.watch_rvs[1])
        assert resumed >= int(moved) > int(mine["metadata"]["resourceVersion"])
    finally:
        gate.open.set()
        lw.stop()
        lw.join(5)


# -- RBAC: the chart's Role and RoleBinding --------------------------------------------------------------

def kubectl(kubeconfig: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    _, binary = tools.ensure_layer_tools()
    return subprocess.run([str(binary), "--kubeconfig", str(kubeconfig), *args], input=stdin, text=True,
                          capture_output=True, timeout=60, check=False,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(kubeconfig.parent)})


def readiness(port: int) -> int:
    """The picker's gRPC readiness status; -1 when the call fails (a busy machine: the caller polls)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        req = health_pb2.HealthCheckRequest(service="readiness")
        try:
            return int(health_pb2_grpc.HealthStub(ch).Check(req, timeout=3.0).status)
        except grpc.RpcError:
            return -1


def test_chart_rbac_is_exactly_what_the_picker_needs(kube: RealKube, rbac_objects: list[dict[str, Any]],
                                                     tmp_path: Path) -> None:
    admin = kube.write_kubeconfig(tmp_path / "admin.kubeconfig")
    binding = next(d for d in rbac_objects if d["kind"] == "RoleBinding")
    sa_ns, sa_name = binding["subjects"][0]["namespace"], binding["subjects"][0]["name"]
    token = kube.token_for(sa_ns, sa_name)
    picker_cfg = kube.write_kubeconfig(tmp_path / "picker.kubeconfig", token)
    if kube.request("GET", f"/api/v1/namespaces/{SA_NAMESPACE}")[0] == 404:
        kube.ok("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                               "metadata": {"name": SA_NAMESPACE}})
    grpc_port, health_port, metrics_port, model_port = free_ports(4)  # nothing listens on model_port
    kube.ok("POST", f"/apis/inference.networking.k8s.io/v1/namespaces/{SA_NAMESPACE}/inferencepools",
            pool("pool", SA_NAMESPACE, {"app": "vllm"}, [model_port]))
    kube.create_pod("vllm-0", {"app": "vllm"}, namespace=SA_NAMESPACE)
    kube.create_pod("vllm-1", {"app": "vllm"}, ip="127.0.0.2", ready=False, namespace=SA_NAMESPACE)
    kube.create_pod("other", {"app": "other"}, ip="127.0.0.3", namespace=SA_NAMESPACE)

    args = prefix_epp("serve", "--pool-name", "pool", "--pool-namespace", SA_NAMESPACE,
                      "--kubeconfig", str(picker_cfg), "--secure-serving=false", "--bind-address", "127.0.0.1",
                      "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
                      "--metrics-port", str(metrics_port))
    http = urllib3.PoolManager()
    with running(args, tmp_path / "picker.log", wait_port=health_port) as picker:
        # Before the Role is bound, the ServiceAccount may do nothing: the picker is not ready.
        until(lambda: "HTTP 403" in picker.log_text(), what="403 before RBAC")
        assert readiness(health_port) != health_pb2.HealthCheckResponse.SERVING
        applied = kubectl(admin, "apply", "-f", "-", stdin="\n---\n".join(orjson.dumps(d).decode()
                                                                        for d in rbac_objects))
        assert applied.returncode == 0, applied.stderr
        until(lambda: readiness(health_port) == health_pb2.HealthCheckResponse.SERVING, timeout=20,
              what="picker ready with the chart's RBAC")
        wait_for_port(metrics_port)

        def ready_pods() -> str:
            text = http.request("GET", f"http://127.0.0.1:{metrics_port}/metrics").data.decode()
            return next((ln for ln in text.splitlines() if ln.startswith("inference_pool_ready_pods{")), "")

        until(lambda: ready_pods().endswith(" 1.0"), what="one ready pod")
        kube.set_pod_status("vllm-1", "127.0.0.2", True, namespace=SA_NAMESPACE)
        until(lambda: ready_pods().endswith(" 2.0"), what="two ready pods")
        assert '"level":"error"' not in picker.log_text()

    # Exactly what it needs: read its pool, pods and objectives in its namespace...
    allowed = [("get", "pods"), ("list", "pods"), ("watch", "pods"),
               ("get", "inferencepools.inference.networking.k8s.io"),
               ("list", "inferencepools.inference.networking.k8s.io"),
               ("watch", "inferencepools.inference.networking.k8s.io"),
               ("list", "inferenceobjectives.inference.networking.x-k8s.io"),
               ("watch", "inferenceobjectives.inference.networking.x-k8s.io")]
    for verb, resource in allowed:
        r = kubectl(picker_cfg, "auth", "can-i", verb, resource, "-n", SA_NAMESPACE)
        assert r.stdout.strip() == "yes", (verb, resource, r.stdout, r.stderr)
    # ...and nothing more: no writes, no other resources, no other namespace.
    denied = [("create", "pods", SA_NAMESPACE), ("delete", "pods", SA_NAMESPACE), ("patch", "pods", SA_NAMESPACE),
              ("update", "inferencepools.inference.networking.k8s.io", SA_NAMESPACE),
              ("delete", "inferencepools.inference.networking.k8s.io", SA_NAMESPACE),
              ("list", "secrets", SA_NAMESPACE), ("get", "configmaps", SA_NAMESPACE),
              ("list", "pods", "default"), ("list", "pods", "kube-system"), ("list", "nodes", "")]
    for verb, resource, ns in denied:
        r = kubectl(picker_cfg, "auth", "can-i", verb, resource, *(["-n", ns] if ns else []))
        assert r.stdout.strip() == "no", (verb, resource, ns, r.stdout, r.stderr)
    # The API itself refuses (not only the review): a forbidden verb is 403.
    status, doc = kube.request("DELETE", f"/api/v1/namespaces/{SA_NAMESPACE}/pods/other", token=token)
    assert status == 403 and doc.get("reason") == "Forbidden"
    status, _ = kube.request("GET", "/api/v1/namespaces/default/pods", token=token)
    assert status == 403
    assert kube.request("GET", f"/api/v1/namespaces/{SA_NAMESPACE}/pods", token=token)[0] == 200
