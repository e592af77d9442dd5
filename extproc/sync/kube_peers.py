"""Kubernetes peers: the ready pods of the picker's own Deployment, by label selector.

A list-then-watch loop (extproc/discovery/watch.py) on Pods in the picker's own namespace (env
NAMESPACE, which the chart sets from the pod; else the pool's) with `--peer-selector` (e.g.
`app.kubernetes.io/name=prefix-epp,app.kubernetes.io/instance=x`), filtered on our side as well.
Peers = pods that are Ready, have a pod IP, are not being deleted and are not this pod (env
POD_NAME, else HOSTNAME); address = `<pod IP>:<--sync-port>`. After every list or event the peer
set is handed to `PeerSync.set_peers`, so scale-up and scale-down are followed live. RBAC:
get/list/watch on pods, which the picker already has for the pool's pods; nothing is added.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

from extproc.config.settings import EppConfig
from extproc.core.datastore import join_host_port
from extproc.discovery.pool import parse_pod, selector_matches
from extproc.discovery.watch import Backoff, ListResult, ListWatch

log = logging.getLogger("prefix_epp.sync")


def parse_selector(selector: str) -> tuple[tuple[str, str], ...]:
    """`k=v,k2=v2` (equality terms only); ValueError otherwise."""
    out = []
    for term in selector.split(","):
        key, sep, value = term.strip().partition("=")
        if not sep or not key or value.startswith("=") or "!" in key:
            raise ValueError(f"peer selector term {term!r}: use key=value")
        out.append((key.strip(), value.strip()))
    return tuple(out)


class PeerPods:
    def __init__(self, config: EppConfig, set_peers: Callable[[Iterable[str]], None],
                 api: Any = None) -> None:
        from extproc.discovery.kubernetes import pool_namespace

        self.config = config
        self.namespace = os.environ.get("NAMESPACE", "") or pool_namespace(config)  # our own pods' namespace
        self.selector = parse_selector(config.sync.peer_selector)
        self.own_name = os.environ.get("POD_NAME") or os.environ.get("HOSTNAME", "")
        self._set_peers = set_peers
        self._api = api
        self._pods: dict[str, dict[str, Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.watch: ListWatch | None = None

    def peers(self) -> list[str]:
        out = []
        for obj in self._pods.values():
            pod = parse_pod(obj)
            if pod.ready and pod.ip and pod.name != self.own_name and selector_matches(pod.labels, self.selector):
                out.append(join_host_port(pod.ip, self.config.sync.port))
        return sorted(out)

    def _publish(self) -> None:
        self._set_peers(self.peers())

    def _on_list(self, result: ListResult) -> None:
        self._pods = {str((o.get("metadata") or {}).get("name", "")): o for o in result.items}
        self._publish()

    def _on_event(self, kind: str, obj: dict[str, Any]) -> None:
        name = str((obj.get("metadata") or {}).get("name", ""))
        if kind == "DELETED":
            self._pods.pop(name, None)
        else:
            self._pods[name] = obj
        self._publish()

    def _to_loop(self, fn: Callable[..., None]) -> Callable[..., None]:
        def call(*args: Any) -> None:
            loop = self._loop
            if loop is not None and not loop.is_closed():
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(fn, *args)
        return call

    async def run(self) -> None:
        from kubernetes import client as k8s_client

        from extproc.discovery.kubernetes import api_client

        self._loop = asyncio.get_running_loop()
        api = self._api or api_client(self.config.kubeconfig)
        core = k8s_client.CoreV1Api(api)
        d = self.config.discovery
        selector = ",".join(f"{k}={v}" for k, v in self.selector)
        self.watch = ListWatch("peer-pods", core.list_namespaced_pod, (self.namespace,),
                               self._to_loop(self._on_list), self._to_loop(self._on_event),
                               query=lambda: {"label_selector": selector},
                               watch_timeout_s=d.watch_timeout_s, request_timeout_s=d.request_timeout_s,
                               backoff=Backoff(d.backoff_initial_s, d.backoff_max_s))
        self.watch.start()
        log.info("peer discovery started", extra={"namespace": self.namespace, "selector": selector})
        try:
            await asyncio.Event().wait()
        finally:
            self.watch.stop()
            await asyncio.to_thread(self.watch.join, d.stop_timeout_s)
