"""A Kubernetes API for tests: kmock's emulator on 127.0.0.1, run in a background thread.

`KubeApi` serves `kmock.KubernetesEmulator` (with the bundled core resources plus InferencePool
v1 and v1alpha2 and InferenceObjective v1alpha2) from its own event loop thread, so blocking
test code and subprocesses (the picker) can both talk to it. Objects are created, patched and
deleted through real HTTP requests, as a controller or kubectl would, so watch events flow.

Faults kmock does not produce by itself:
- `gone_on_next_watch(plural)`: the next WATCH of that resource gets HTTP 410 (or, with
  `as_event=True`, a 200 stream carrying one ERROR event with code 410), through kmock's own
  request-matching DSL: a reaction on the slice [n:n+1] of that resource's WATCH requests.
- `cut_watches(plural)`: ends every open WATCH stream of that resource (emulator subclass).
- `forget(...)`: hard-deletes an object without any watch event, as if its DELETED event had
  been lost while a client was disconnected; only a relist reveals it.
- `start()` on a fixed port after the picker: the API is down at the picker's start-up.
kmock still ignores label selectors and resourceVersion, and replays every object as ADDED on
each watch (see /work/shared/reference/k8s-and-tools-notes.md section 2.2).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import attrs
import kmock
import orjson
import urllib3

from testkit.procs import free_port

T = TypeVar("T")
POOL_V1 = ("inference.networking.k8s.io", "v1", "inferencepools")
POOL_LEGACY = ("inference.networking.x-k8s.io", "v1alpha2", "inferencepools")
OBJECTIVES = ("inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives")
OBJECTIVES_LLMD = ("llm-d.ai", "v1alpha2", "inferenceobjectives")
PODS = ("", "v1", "pods")


@attrs.define(kw_only=True)
class CuttableEmulator(kmock.KubernetesEmulator):  # type: ignore[misc]
    """The emulator, with watch streams that `cut(plural)` can end."""

    _cuts: dict[str, asyncio.Event] = attrs.field(factory=dict, init=False)
    closing: bool = attrs.field(default=False, init=False)  # end every watch at once (server shutdown)

    def cut(self, plural: str) -> None:
        event = self._cuts.pop(plural, None)
        if event is not None:
            event.set()

    def cut_all(self) -> None:
        for plural in list(self._cuts):
            self.cut(plural)

    async def _serve_watch(self, request: Any) -> AsyncIterator[Any]:
        if self.closing:
            raise kmock.KubernetesError(503, "ServiceUnavailable", "shutting down")
        plural = request.resource.plural
        cut = self._cuts.setdefault(plural, asyncio.Event())
        gen = super()._serve_watch(request)
        waiter = asyncio.ensure_future(cut.wait())
        nxt: asyncio.Future[Any] | None = None
        try:
            while True:
                nxt = asyncio.ensure_future(anext(gen))
                done, _ = await asyncio.wait({nxt, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    return
                try:
                    item = nxt.result()
                except StopAsyncIteration:
                    return
                nxt = None
                yield item
        finally:
            waiter.cancel()
            if nxt is not None and not nxt.done():
                nxt.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await nxt
            await gen.aclose()  # type: ignore[attr-defined]


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
            "code": code, "reason": reason, "message": message}


class KubeApi:
    def __init__(self, port: int | None = None,
                 objectives: tuple[tuple[str, str, str], ...] = (OBJECTIVES,)) -> None:
        """`objectives`: the InferenceObjective APIs this server has (none: the CRD is missing)."""
        self.port = port or free_port()
        self.objective_apis = objectives
        self.emulator: CuttableEmulator | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kmock", daemon=True)
        self._thread.start()
        self._server: Any = None
        self._http = urllib3.PoolManager()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> KubeApi:
        async def go() -> None:
            if self.emulator is None:
                em = CuttableEmulator()
                await em.__aenter__()
                em.resources.load_bundled()
                for group, version, plural in (POOL_V1, POOL_LEGACY, *self.objective_apis):
                    kind = "InferencePool" if plural == "inferencepools" else "InferenceObjective"
                    em.resources[f"{group}/{version}/{plural}"] = kmock.ResourceInfo(
                        kind=kind, singular=kind.lower(), namespaced=True,
                        verbs={"get", "list", "watch", "create", "update", "patch", "delete"})
                self.emulator = em
            self._server = kmock.Server(self.emulator, port=self.port)
            await self._server.__aenter__()

        self._run(go())
        return self

    def install_objective_api(self, api: tuple[str, str, str]) -> None:
        """Register an InferenceObjective API while serving, as installing its CRD would."""
        async def go() -> None:
            assert self.emulator is not None
            self.emulator.resources[f"{api[0]}/{api[1]}/{api[2]}"] = kmock.ResourceInfo(
                kind="InferenceObjective", singular="inferenceobjective", namespaced=True,
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"})

        self._run(go())

    def stop_server(self) -> None:
        """Stop serving (the stored objects survive; `start()` serves them again)."""
        if self._server is not None:
            server, self._server = self._server, None

            async def go() -> None:
                assert self.emulator is not None
                self.emulator.closing = True  # open watch streams would hold the shutdown
                self.emulator.cut_all()
                try:
                    await server.__aexit__(None, None, None)
                finally:
                    self.emulator.closing = False

            self._run(go(), timeout=30)

    def close(self) -> None:
        self.stop_server()
        if self.emulator is not None:
            self._run(self.emulator.__aexit__(None, None, None))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> KubeApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write_kubeconfig(self, path: Path) -> Path:
        path.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: kmock\n"
            f"clusters:\n- name: kmock\n  cluster:\n    server: {self.url}\n"
            "contexts:\n- name: kmock\n  context:\n    cluster: kmock\n    user: anonymous\n"
            "users:\n- name: anonymous\n  user: {}\n")
        return path

    # -- objects over HTTP ----------------------------------------------------------------------
    @staticmethod
    def _path(res: tuple[str, str, str], namespace: str, name: str = "") -> str:
        group, version, plural = res
        base = f"/api/{version}" if not group else f"/apis/{group}/{version}"
        return f"{base}/namespaces/{namespace}/{plural}" + (f"/{name}" if name else "")

    def _request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        headers = {"content-type": "application/merge-patch+json" if method == "PATCH" else "application/json"}
        resp = self._http.request(method, self.url + path, body=orjson.dumps(body) if body is not None else None,
                                  headers=headers, timeout=5.0)
        if resp.status >= 300:
            raise RuntimeError(f"{method} {path}: HTTP {resp.status} {resp.data[:300]!r}")
        doc: dict[str, Any] = orjson.loads(resp.data) if resp.data else {}
        return doc

    def create(self, res: tuple[str, str, str], obj: dict[str, Any]) -> dict[str, Any]:
        ns = obj["metadata"].setdefault("namespace", "default")  # kmock routes live events by it
        return self._request("POST", self._path(res, ns), obj)

    def patch(self, res: tuple[str, str, str], name: str, patch: dict[str, Any],
              namespace: str = "default") -> dict[str, Any]:
        return self._request("PATCH", self._path(res, namespace, name), patch)

    def delete(self, res: tuple[str, str, str], name: str, namespace: str = "default") -> None:
        self._request("DELETE", self._path(res, namespace, name))

    def forget(self, res: tuple[str, str, str], name: str, namespace: str = "default") -> None:
        """Hard-delete an object without a watch event."""
        async def go() -> None:
            assert self.emulator is not None
            del self.emulator.objects[kmock.resource(*res), namespace, name]

        self._run(go())

    def wait_watching(self, *resources: tuple[str, str, str], timeout: float = 5.0) -> None:
        """Block until each resource has an open watch subscribed to kmock's event bus.

        kmock replays the objects when a watch arrives and subscribes to its live-event bus only
        after that, so a change made in between reaches no watch (a real apiserver resumes from
        resourceVersion). Tests call this after the picker synced and before they change objects.
        """
        async def go() -> None:
            assert self.emulator is not None
            deadline = asyncio.get_running_loop().time() + timeout
            buses = self.emulator._buses  # kmock keeps one event bus per resource
            while any(buses[kmock.resource(*r)].consumer_count < 1 for r in resources):
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"no watch subscribed for {resources}")
                await asyncio.sleep(0.005)

        self._run(go(), timeout=timeout + 1)

    # -- faults ---------------------------------------------------------------------------------
    def watch_count(self, res: tuple[str, str, str]) -> int:
        async def go() -> int:
            assert self.emulator is not None
            return len(list(self.emulator[kmock.action.WATCH, kmock.resource(*res)]))

        return self._run(go())

    def gone_on_next_watch(self, res: tuple[str, str, str], as_event: bool = False) -> None:
        """Answer the next WATCH of `res` with 410 Gone (HTTP status, or an ERROR event)."""
        async def go() -> None:
            assert self.emulator is not None
            view = self.emulator[kmock.action.WATCH, kmock.resource(*res)]
            n = len(list(view))
            status = _status(410, "Expired", "too old resource version")
            if as_event:
                view[n:n + 1] << ({"type": "ERROR", "object": status},)
            else:
                view[n:n + 1] << 410 << status

        self._run(go())

    def cut_watches(self, res: tuple[str, str, str]) -> None:
        async def go() -> None:
            assert self.emulator is not None
            self.emulator.cut(res[2])

        self._run(go())


def pool_v1(name: str, selector: dict[str, str], ports: list[int], namespace: str = "default") -> dict[str, Any]:
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": {"matchLabels": selector}, "targetPorts": [{"number": p} for p in ports]}}


def pool_legacy(name: str, selector: dict[str, str], port: int, namespace: str = "default") -> dict[str, Any]:
    return {"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": selector, "targetPortNumber": port}}


def pod(name: str, labels: dict[str, str], ip: str = "127.0.0.1", ready: bool = True,
        active_ports: list[int] | None = None, namespace: str = "default") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if active_ports is not None:
        meta["annotations"] = {"inference.networking.k8s.io/active-ports": ",".join(map(str, active_ports))}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "status": {"phase": "Running", "podIP": ip, "conditions": [ready_condition(ready)]}}


def ready_condition(ready: bool) -> dict[str, str]:
    return {"type": "Ready", "status": "True" if ready else "False"}


def objective(name: str, pool: str, priority: int | None, namespace: str = "default",
              api: tuple[str, str, str] = OBJECTIVES) -> dict[str, Any]:
    spec: dict[str, Any] = {"poolRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                        "name": pool}}
    if priority is not None:
        spec["priority"] = priority
    return {"apiVersion": f"{api[0]}/{api[1]}", "kind": "InferenceObjective",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}
