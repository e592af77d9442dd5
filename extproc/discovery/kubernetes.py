"""Kubernetes discovery: the InferencePool, its Pods and the InferenceObjectives -> the datastore.

Three list-then-watch loops (extproc/discovery/watch.py), each in a worker thread, in the pool's
namespace (`--pool-namespace`, else env NAMESPACE, else `default`):
- the InferencePool `--pool-name` of `--pool-group` (v1, or legacy v1alpha2), by field selector
  `metadata.name` and filtered by name on our side as well;
- the Pods, by the pool's label selector, applied on our side as well (kmock ignores selectors).
  This loop starts when the pool is first seen, and relists when the selector changes;
- the InferenceObjectives of whichever API group is installed (llm-d.ai or the older
  inference.networking.x-k8s.io, probed at start-up; a missing CRD is logged once and probed
  again slowly: extproc/discovery/objectives.py): name -> spec.priority for those whose poolRef
  is our pool. `priority_of(name)` is the director's hook; unknown -> 0.
Worker threads never touch the datastore: each result is handed to the event loop with
`loop.call_soon_threadsafe` and applied there, so the request path never waits on the API.

On the loop, state is the pool spec and every listed pod; after each change the wanted endpoint
set (extproc/discovery/pool.py: pod_endpoints) is diffed against what we published, with
`Datastore.upsert`/`remove` per endpoint (removal purges the prefix index at once). A pool edit
(selector or ports) takes effect without restart: endpoints are recomputed from the known pods
at once and the pods are listed again with the new selector. A deleted pool empties the set.

Readiness: `datastore.synced` is True once the pool and then its pods have been listed; until
then, and after the pool is deleted, it is False, so gRPC readiness reports NOT_SERVING. A
selector change keeps readiness (the known pods are re-filtered at once, the relist follows).
When the API is down the loops retry with capped, jittered backoff.

A pod's KV-events annotation naming another host than the pod (extproc/discovery/pool.py) is
refused: logged once per pod and annotation value, counted in `refused_annotations`.

Client configuration: `--kubeconfig`, else env KUBECONFIG, else in-cluster, else ~/.kube/config.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from extproc.config.settings import DiscoveryConfig, EppConfig
from extproc.core.datastore import Datastore, EndpointSpec
from extproc.discovery.objectives import ObjectiveDiscovery
from extproc.discovery.pool import (
    KV_EVENTS_ANNOTATION,
    POOL_PLURAL,
    PodInfo,
    PoolError,
    PoolSpec,
    parse_pod,
    parse_pool,
    pod_endpoints,
    pool_version,
)
from extproc.discovery.watch import Backoff, ListResult, ListWatch

log = logging.getLogger("prefix_epp.discovery")


def pool_namespace(config: EppConfig) -> str:
    return config.pool_namespace or os.environ.get("NAMESPACE", "") or "default"


def api_client(kubeconfig: str) -> k8s_client.ApiClient:
    """An ApiClient from --kubeconfig, KUBECONFIG, the in-cluster service account or ~/.kube/config."""
    cfg = k8s_client.Configuration()
    if kubeconfig or os.environ.get("KUBECONFIG"):
        k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig or None, client_configuration=cfg)
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    else:
        k8s_config.load_kube_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    cfg.retries = 0  # our loops retry with backoff; urllib3's own retries would only add delay
    return k8s_client.ApiClient(cfg)


class KubernetesDiscovery:
    def __init__(self, config: EppConfig, datastore: Datastore,
                 api: k8s_client.ApiClient | None = None) -> None:
        self.config = config
        self.datastore = datastore
        self.namespace = pool_namespace(config)
        self.pool_name = config.pool_name
        self.group = config.pool_group
        self.version = pool_version(config.pool_group)  # raises PoolError on an unknown group
        self._api = api
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: PoolSpec | None = None
        self._pods: dict[str, PodInfo] = {}
        self._pods_listed = False  # a pods LIST has been applied since the pool appeared
        self._published: dict[str, EndpointSpec] = {}
        self._selector = ""  # read by the pods thread when it lists or watches
        self.pool_watch: ListWatch | None = None
        self.pods_watch: ListWatch | None = None
        self.objectives: ObjectiveDiscovery | None = None
        self.refused_annotations = 0  # KV-events annotations refused (pods and values as they changed)

    # -- request path ---------------------------------------------------------------------------
    def priority_of(self, objective: str) -> int:
        return self.objectives.priority_of(objective) if self.objectives is not None else 0

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Watch until cancelled; then stop the threads (bounded wait)."""
        self._loop = asyncio.get_running_loop()
        if self._api is None:
            self._api = api_client(self.config.kubeconfig)
        custom = k8s_client.CustomObjectsApi(self._api)
        self.pool_watch = self._watch(
            "inferencepools", custom.list_namespaced_custom_object,
            (self.group, self.version, self.namespace, POOL_PLURAL), self._on_pool_list, self._on_pool_event,
            query=lambda: {"field_selector": f"metadata.name={self.pool_name}"})
        self.objectives = ObjectiveDiscovery(
            custom.list_namespaced_custom_object, self.namespace, self.pool_name, self.config.discovery,
            self._to_loop, self._watch)
        self.pool_watch.start()
        self.objectives.start()
        log.info("kubernetes discovery started", extra={
            "pool": self.pool_name, "namespace": self.namespace, "group": self.group})
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        watches = [w for w in (self.pool_watch, self.pods_watch) if w is not None]
        for w in watches:
            w.stop()
        objectives = self.objectives
        if objectives is not None:
            objectives.stop()
        deadline = asyncio.get_running_loop().time() + self.config.discovery.stop_timeout_s
        while ((any(not w.join(0) for w in watches) or (objectives is not None and not objectives.join(0)))
               and asyncio.get_running_loop().time() < deadline):
            await asyncio.sleep(0.01)
        alive = [w.name for w in watches if not w.join(0)] + (objectives.alive() if objectives is not None else [])
        if alive:
            log.warning("watch threads still running after stop", extra={"watches": alive})

    def _watch(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
               on_list: Callable[[ListResult], None], on_event: Callable[[str, dict[str, Any]], None],
               query: Callable[[], dict[str, Any]] = dict) -> ListWatch:
        d: DiscoveryConfig = self.config.discovery
        return ListWatch(name, fn, args, self._to_loop(on_list), self._to_loop(on_event), query=query,
                         watch_timeout_s=d.watch_timeout_s, request_timeout_s=d.request_timeout_s,
                         backoff=Backoff(d.backoff_initial_s, d.backoff_max_s))

    def _to_loop(self, fn: Callable[..., None]) -> Callable[..., None]:
        def call(*args: Any) -> None:
            loop = self._loop
            if loop is not None and not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop closed in between: shutting down
                    loop.call_soon_threadsafe(fn, *args)
        return call

    # -- pool (loop thread) ---------------------------------------------------------------------
    def _on_pool_list(self, result: ListResult) -> None:
        ours = [o for o in result.items if (o.get("metadata") or {}).get("name") == self.pool_name]
        self._set_pool(ours[0] if ours else None)

    def _on_pool_event(self, kind: str, obj: dict[str, Any]) -> None:
        if (obj.get("metadata") or {}).get("name") != self.pool_name:
            return
        self._set_pool(None if kind == "DELETED" else obj)

    def _set_pool(self, obj: dict[str, Any] | None) -> None:
        if obj is None:
            if self._pool is not None:
                log.warning("InferencePool deleted; no endpoints until it returns", extra={"pool": self.pool_name})
            self._pool = None
            self._pods_listed = False
            self._publish()
            return
        try:
            spec = parse_pool(obj, self.group)
        except PoolError as exc:
            log.error("InferencePool is invalid; keeping the last valid one",
                      extra={"pool": self.pool_name, "error": str(exc)})
            return
        if spec == self._pool:
            return
        old = self._pool
        self._pool = spec
        log.info("InferencePool applied", extra={
            "pool": spec.name, "selector": spec.label_selector(), "target_ports": list(spec.target_ports)})
        self._selector = spec.label_selector()
        if self.pods_watch is None:
            self.pods_watch = self._watch(
                "pods", k8s_client.CoreV1Api(self._api).list_namespaced_pod, (self.namespace,),
                self._on_pod_list, self._on_pod_event, query=lambda: {"label_selector": self._selector})
            self.pods_watch.start()
        elif old is None or old.selector != spec.selector:
            self.pods_watch.relist()  # readiness holds: known pods are re-filtered at once below
        self._publish()

    # -- pods (loop thread) ---------------------------------------------------------------------
    def _on_pod_list(self, result: ListResult) -> None:
        pods = {p.name: p for p in (parse_pod(o) for o in result.items) if p.name}
        for pod in pods.values():
            self._check_annotation(pod)
        self._pods = pods
        self._pods_listed = self._pool is not None
        self._publish()

    def _on_pod_event(self, kind: str, obj: dict[str, Any]) -> None:
        pod = parse_pod(obj)
        if kind == "DELETED":
            self._pods.pop(pod.name, None)
        else:
            self._check_annotation(pod)
            self._pods[pod.name] = pod
        self._publish()

    def _check_annotation(self, pod: PodInfo) -> None:
        """Count and log a refused KV-events annotation when it is new for this pod."""
        old = self._pods.get(pod.name)
        if not pod.kv_events_refused or (old is not None and old.kv_events_refused and old.ip == pod.ip
                                         and old.kv_events_raw == pod.kv_events_raw):
            return
        self.refused_annotations += 1
        log.warning("kv-events annotation refused: a pod may only name ports on its own IP", extra={
            "pod": pod.name, "pod_ip": pod.ip, "annotation": KV_EVENTS_ANNOTATION,
            "value": pod.kv_events_raw[:200], "reason": pod.kv_events_refused})

    def _publish(self) -> None:
        """Diff the wanted endpoints against the published ones; update readiness."""
        wanted: dict[str, EndpointSpec] = {}
        pool = self._pool
        if pool is not None:
            for pod in self._pods.values():
                if pod.namespace and pod.namespace != self.namespace:
                    continue
                for spec in pod_endpoints(pod, pool):
                    wanted.setdefault(spec.key, spec)
        for key in [k for k in self._published if k not in wanted]:
            del self._published[key]
            self.datastore.remove(key)
            log.info("endpoint removed", extra={"endpoint": key})
        for key, spec in wanted.items():
            if self._published.get(key) != spec:
                if key not in self._published:
                    log.info("endpoint added", extra={"endpoint": key, "endpoint_name": spec.name})
                self._published[key] = spec
                self.datastore.upsert(spec)
        synced = pool is not None and self._pods_listed
        if synced != self.datastore.synced:
            log.info("discovery synced" if synced else "discovery not synced",
                     extra={"pool": self.pool_name, "endpoints": len(wanted)})
        self.datastore.synced = synced
