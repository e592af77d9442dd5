"""InferenceObjectives from whichever API group the cluster serves -> name -> priority.

InferenceObjective exists in two API groups (both `v1alpha2`, same spec: `poolRef`, `priority`):
- `llm-d.ai`, the llm-d router's, where it lives since the Inference Extension v1.6.0 dropped it;
- `inference.networking.x-k8s.io`, the Inference Extension's own up to v1.5.
At start-up a worker thread probes each group with a LIST (limit 1) in the pool's namespace:
- 200: the group is served; a list-then-watch loop (extproc/discovery/watch.py) keeps its
  objectives (those whose `poolRef.name` is our pool) in sync;
- 404: the CRD is not installed; 403: no RBAC for it. Such a group is logged once and probed
  again every `objective_recheck_interval_s` (default 60 s), never in a tight loop; once it
  appears it is watched (logged once again).
- other failures (API unreachable): probed again after a capped, jittered backoff.
Every group found is watched; a name present in both resolves to the llm-d.ai one (listed first).
`priority_of(name)` is the director's hook (request path, a dict lookup); unknown -> 0.
Worker threads never touch this state: results reach the event loop through `to_loop`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

from extproc.config.settings import DiscoveryConfig
from extproc.discovery.pool import objective_priority
from extproc.discovery.watch import Backoff, ListResult, ListWatch

log = logging.getLogger("prefix_epp.discovery")

OBJECTIVE_VERSION = "v1alpha2"
OBJECTIVE_PLURAL = "inferenceobjectives"
# Preference order: the maintained group first.
OBJECTIVE_GROUPS = ("llm-d.ai", "inference.networking.x-k8s.io")

ToLoop = Callable[[Callable[..., None]], Callable[..., None]]
WatchFactory = Callable[[str, Callable[..., Any], tuple[Any, ...], Callable[[ListResult], None],
                         Callable[[str, dict[str, Any]], None]], ListWatch]


class ObjectiveDiscovery:
    def __init__(self, list_fn: Callable[..., Any], namespace: str, pool_name: str, config: DiscoveryConfig,
                 to_loop: ToLoop, make_watch: WatchFactory) -> None:
        self._list_fn = list_fn
        self._namespace = namespace
        self._pool_name = pool_name
        self._config = config
        self._to_loop = to_loop
        self._make_watch = make_watch
        self._by_group: dict[str, dict[str, int]] = {g: {} for g in OBJECTIVE_GROUPS}
        self._merged: dict[str, int] = {}
        self.watches: dict[str, ListWatch] = {}
        self.probes = 0  # probe requests made (tests: no tight loop)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe_loop, name="probe-inferenceobjectives", daemon=True)

    # -- request path ---------------------------------------------------------------------------
    def priority_of(self, name: str) -> int:
        return self._merged.get(name, 0)

    # -- lifecycle (loop thread) ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        for w in list(self.watches.values()):
            w.stop()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive() and all(w.join(0) for w in list(self.watches.values()))

    def alive(self) -> list[str]:
        names = [w.name for w in list(self.watches.values()) if not w.join(0)]
        return names + ([self._thread.name] if self._thread.is_alive() else [])

    # -- probing (worker thread) ----------------------------------------------------------------
    def _probe(self, group: str) -> int:
        """HTTP status of a LIST of this group's objectives (0: no answer)."""
        self.probes += 1
        try:
            self._list_fn(group, OBJECTIVE_VERSION, self._namespace, OBJECTIVE_PLURAL, limit=1,
                          _request_timeout=self._config.request_timeout_s, _preload_content=False).release_conn()
        except ApiException as exc:
            return int(exc.status or 0)
        except Exception:  # connection refused, timeout: the API is unreachable
            return 0
        return 200

    def _probe_loop(self) -> None:
        pending = list(OBJECTIVE_GROUPS)
        reported: dict[str, int] = {}
        backoff = Backoff(self._config.backoff_initial_s, self._config.backoff_max_s)
        while pending and not self._stop.is_set():
            unreachable = False
            for group in list(pending):
                status = self._probe(group)
                if status == 200:
                    pending.remove(group)
                    log.info("InferenceObjective API found; watching it", extra={"group": group})
                    self._to_loop(self._start_watch)(group)
                elif status in (403, 404):
                    if reported.get(group) != status:
                        reported[group] = status
                        log.info("InferenceObjective CRD not installed" if status == 404 else
                                 "InferenceObjective not readable (RBAC)", extra={
                                     "group": group, "status": status,
                                     "recheck_s": self._config.objective_recheck_interval_s,
                                     "effect": "priorities from this group default to 0"})
                else:
                    unreachable = True
            if not pending:
                return
            if unreachable:
                self._stop.wait(backoff.next())
            else:
                backoff.reset()
                self._stop.wait(self._config.objective_recheck_interval_s)

    # -- watching (loop thread) -----------------------------------------------------------------
    def _start_watch(self, group: str) -> None:
        if self._stop.is_set() or group in self.watches:
            return
        watch = self._make_watch(
            f"inferenceobjectives.{group}", self._list_fn,
            (group, OBJECTIVE_VERSION, self._namespace, OBJECTIVE_PLURAL),
            lambda result: self._on_list(group, result), lambda kind, obj: self._on_event(group, kind, obj))
        self.watches[group] = watch
        watch.start()

    def _on_list(self, group: str, result: ListResult) -> None:
        self._by_group[group] = {}
        for obj in result.items:
            self._apply(group, "ADDED", obj)
        self._merge()

    def _on_event(self, group: str, kind: str, obj: dict[str, Any]) -> None:
        self._apply(group, kind, obj)
        self._merge()

    def _apply(self, group: str, kind: str, obj: dict[str, Any]) -> None:
        name = (obj.get("metadata") or {}).get("name")
        if not name:
            return
        priority = None if kind == "DELETED" else objective_priority(obj, self._pool_name)
        if priority is None:
            self._by_group[group].pop(name, None)
        else:
            self._by_group[group][name] = priority

    def _merge(self) -> None:
        merged: dict[str, int] = {}
        for group in reversed(OBJECTIVE_GROUPS):  # the preferred group overwrites
            merged.update(self._by_group[group])
        self._merged = merged
