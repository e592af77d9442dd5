"""The generic list-then-watch loop against kmock: events, 410 Gone, cut streams, outages, stop."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from extproc.discovery.watch import Backoff, ListResult, ListWatch
from testkit.kube import PODS, KubeApi, pod
from testkit.procs import free_port


class Recorder:
    def __init__(self) -> None:
        self.lists: list[list[str]] = []
        self.events: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def on_list(self, r: ListResult) -> None:
        with self.lock:
            self.lists.append(sorted(o["metadata"]["name"] for o in r.items))

    def on_event(self, kind: str, obj: dict[str, Any]) -> None:
        with self.lock:
            self.events.append((kind, obj["metadata"]["name"]))

    def wait(self, cond: Any, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if cond(self):
                    return
            time.sleep(0.005)
        raise TimeoutError(f"lists={self.lists} events={self.events[-10:]}")


def core_api(api: KubeApi) -> client.CoreV1Api:
    cfg = client.Configuration()
    cfg.host = api.url
    cfg.retries = 0
    return client.CoreV1Api(client.ApiClient(cfg))


@pytest.fixture
def api() -> Iterator[KubeApi]:
    with KubeApi() as a:
        a.start()
        yield a


def pods_watch(api: KubeApi, rec: Recorder, **kw: Any) -> ListWatch:
    kw.setdefault("backoff", Backoff(0.05, 0.2))
    return ListWatch("pods", core_api(api).list_namespaced_pod, ("default",), rec.on_list, rec.on_event,
                     query=lambda: {"label_selector": "app=v"}, **kw)


def test_list_then_live_events(api: KubeApi) -> None:
    api.create(PODS, pod("a", {"app": "v"}))
    rec = Recorder()
    w = pods_watch(api, rec)
    w.start()
    try:
        rec.wait(lambda r: r.lists == [["a"]] and ("ADDED", "a") in r.events)  # kmock replays "a" as ADDED
        api.wait_watching(PODS)
        api.create(PODS, pod("b", {"app": "v"}))
        api.patch(PODS, "a", {"metadata": {"labels": {"x": "y"}}})
        api.delete(PODS, "b")
        rec.wait(lambda r: r.events[-3:] == [("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")])
        assert w.lists == 1
    finally:
        w.stop()
        assert w.join(5.0)


@pytest.mark.parametrize("as_event", [False, True])
def test_410_gone_leads_to_a_fresh_list(api: KubeApi, as_event: bool) -> None:
    api.create(PODS, pod("a", {"app": "v"}))
    api.create(PODS, pod("b", {"app": "v"}))
    rec = Recorder()
    w = pods_watch(api, rec)
    w.start()
    try:
        rec.wait(lambda r: len(r.lists) == 1 and len(r.events) == 2)
        api.gone_on_next_watch(PODS, as_event=as_event)
        api.forget(PODS, "b")  # its DELETED event is "lost": only a list can reveal it
        api.cut_watches(PODS)
        rec.wait(lambda r: r.lists[-1:] == [["a"]])
        assert w.lists == 2
    finally:
        w.stop()
        assert w.join(5.0)


def test_a_cut_stream_is_watched_again_without_a_list(api: KubeApi) -> None:
    api.create(PODS, pod("a", {"app": "v"}))
    rec = Recorder()
    w = pods_watch(api, rec)
    w.start()
    try:
        rec.wait(lambda r: len(r.events) == 1)
        watches = api.watch_count(PODS)
        api.cut_watches(PODS)
        rec.wait(lambda r: len(r.events) == 2)  # the new watch replays "a"
        api.wait_watching(PODS)
        api.create(PODS, pod("c", {"app": "v"}))
        rec.wait(lambda r: ("ADDED", "c") in r.events)
        assert api.watch_count(PODS) == watches + 1 and w.lists == 1
    finally:
        w.stop()
        assert w.join(5.0)


def test_a_quiet_stream_times_out_and_is_watched_again(api: KubeApi) -> None:
    rec = Recorder()
    w = pods_watch(api, rec, watch_timeout_s=0.4)  # read timeout 1..1.8 s; kmock never ends a stream
    w.start()
    try:
        rec.wait(lambda r: len(r.lists) == 1)
        first = api.watch_count(PODS)
        deadline = time.monotonic() + 15
        while api.watch_count(PODS) == first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert api.watch_count(PODS) == first + 1 and w.lists == 1
    finally:
        w.stop()
        assert w.join(5.0)


def test_api_down_at_start_is_retried_with_backoff() -> None:
    port = free_port()
    with KubeApi(port) as api:
        rec = Recorder()
        w = ListWatch("pods", core_api(api).list_namespaced_pod, ("default",), rec.on_list, rec.on_event,
                      backoff=Backoff(0.05, 0.3))
        w.start()
        try:
            deadline = time.monotonic() + 15  # two refused LISTs: it tried, and tried again after a backoff
            while w.failures < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert w.failures >= 2 and rec.lists == [] and w.lists == 0
            api.start()
            api.create(PODS, pod("a", {"app": "v"}))
            # The first successful LIST may land before or after the create; either way the pod is seen.
            rec.wait(lambda r: len(r.lists) >= 1 and (["a"] in r.lists or ("ADDED", "a") in r.events), timeout=15)
            listed = len(rec.lists)
            failed = w.failures
            api.stop_server()  # an outage while watching: list again once it is back
            deadline = time.monotonic() + 15
            while w.failures == failed and time.monotonic() < deadline:
                time.sleep(0.01)
            assert w.failures > failed
            api.start()  # the object store survived the restart
            rec.wait(lambda r: len(r.lists) > listed and r.lists[-1] == ["a"], timeout=15)
        finally:
            w.stop()
            assert w.join(5.0)


def test_stop_is_prompt_while_blocked_in_a_watch_and_relist_is_on_demand(api: KubeApi) -> None:
    rec = Recorder()
    w = pods_watch(api, rec, watch_timeout_s=300)
    w.start()
    rec.wait(lambda r: len(r.lists) == 1)
    api.wait_watching(PODS)  # blocked in its first watch
    watches = api.watch_count(PODS)
    w.relist()
    rec.wait(lambda r: len(r.lists) == 2)
    deadline = time.monotonic() + 15
    while api.watch_count(PODS) == watches and time.monotonic() < deadline:  # the watch after the new list
        time.sleep(0.01)
    assert api.watch_count(PODS) > watches
    t0 = time.monotonic()
    w.stop()
    assert w.join(5.0)
    assert time.monotonic() - t0 < 3.0  # prompt: far below the 300 s watch timeout


def test_backoff_is_capped_jittered_and_the_first_410_is_free() -> None:
    b = Backoff(0.1, 1.0)
    delays = [b.next() for _ in range(8)]
    assert 0.05 <= delays[0] <= 0.1 and all(0.5 <= d <= 1.0 for d in delays[4:])
    b.reset()
    assert b.next(first_free=True) == 0.0 and b.next(first_free=True) > 0
