"""KubernetesDiscovery against kmock: pool, pods and objectives reach the datastore on the loop; a pod's
KV-events annotation naming another host is refused."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from extproc.config.settings import DiscoveryConfig, EppConfig
from extproc.core.datastore import Datastore
from extproc.discovery.kubernetes import KubernetesDiscovery, pool_namespace
from extproc.kvevents.ranks import source_addresses
from extproc.prefix.index import PrefixIndex
from extproc.telemetry.discovery import DiscoveryCollector
from testkit.kube import (
    OBJECTIVES,
    PODS,
    POOL_LEGACY,
    POOL_V1,
    KubeApi,
    objective,
    pod,
    pool_legacy,
    pool_v1,
    ready_condition,
)

FAST = DiscoveryConfig(backoff_initial_s=0.05, backoff_max_s=0.3)


@pytest.fixture
def api() -> Iterator[KubeApi]:
    with KubeApi() as a:
        a.start()
        yield a


@asynccontextmanager
async def discovery(api: KubeApi, tmp: Path, **cfg: object) -> AsyncIterator[tuple[KubernetesDiscovery, Datastore]]:
    config = replace(EppConfig(), pool_name="pool", kubeconfig=str(api.write_kubeconfig(tmp / "kubeconfig")),
                     discovery=FAST, **cfg)  # type: ignore[arg-type]
    ds = Datastore()
    d = KubernetesDiscovery(config, ds)
    task = asyncio.create_task(d.run())
    try:
        yield d, ds
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> float:
    """Wait for cond on the loop; returns the seconds it took."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


def names(ds: Datastore) -> set[str]:
    return {ep.spec.name for ep in ds.snapshot()}


async def test_pods_come_and_go_with_readiness_labels_and_deletion(api: KubeApi, tmp_path: Path) -> None:
    api.create(POOL_V1, pool_v1("pool", {"app": "v"}, [8000]))
    api.create(PODS, pod("a", {"app": "v"}, ip="10.0.0.1"))
    api.create(PODS, pod("b", {"app": "v"}, ip="10.0.0.2", ready=False))
    api.create(PODS, pod("other", {"app": "x"}, ip="10.0.0.9"))  # kmock ignores the selector: we filter
    async with discovery(api, tmp_path) as (_, ds):
        index = PrefixIndex(100)
        ds.on_removed(lambda ep: index.remove_endpoint(ep.key))
        await until(lambda: ds.synced)
        api.wait_watching(PODS)
        assert names(ds) == {"a-rank-0"}
        index.record("10.0.0.1:8000", [1, 2, 3])
        api.patch(PODS, "b", {"status": {"conditions": [ready_condition(True)]}})
        await until(lambda: names(ds) == {"a-rank-0", "b-rank-0"})
        api.patch(PODS, "b", {"metadata": {"labels": {"app": "elsewhere"}}})
        await until(lambda: names(ds) == {"a-rank-0"})
        api.patch(PODS, "b", {"metadata": {"labels": {"app": "v"}}})
        await until(lambda: names(ds) == {"a-rank-0", "b-rank-0"})
        api.patch(PODS, "a", {"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}})  # terminating
        await until(lambda: names(ds) == {"b-rank-0"})
        assert index.endpoints() == []  # left the prefix index at once
        api.delete(PODS, "b")
        await until(lambda: len(ds) == 0)
        assert ds.synced  # an empty pool is still a synced pool


async def test_pool_edits_take_effect_without_restart(api: KubeApi, tmp_path: Path) -> None:
    api.create(POOL_V1, pool_v1("pool", {"app": "v"}, [8000, 8001]))
    api.create(POOL_V1, pool_v1("another-pool", {"app": "w"}, [9000]))
    api.create(PODS, pod("a", {"app": "v"}, ip="10.0.0.1", active_ports=[8001]))
    api.create(PODS, pod("w", {"app": "w"}, ip="10.0.0.3"))
    async with discovery(api, tmp_path) as (d, ds):
        await until(lambda: ds.synced)
        api.wait_watching(POOL_V1, PODS)
        assert {ep.key: ep.spec.name for ep in ds.snapshot()} == {"10.0.0.1:8001": "a-rank-1"}
        api.patch(POOL_V1, "pool", {"spec": {"targetPorts": [{"number": 8001}, {"number": 8002}]}})
        await until(lambda: names(ds) == {"a-rank-0"})  # 8001 is now rank 0
        lists = d.pods_watch.lists if d.pods_watch else 0
        api.patch(POOL_V1, "pool", {"spec": {"selector": {"matchLabels": {"app": "w"}}}})
        await until(lambda: {ep.key for ep in ds.snapshot()} == {"10.0.0.3:8001", "10.0.0.3:8002"})
        assert d.pods_watch is not None
        await until(lambda: d.pods_watch is not None and d.pods_watch.lists > lists)  # relisted, new selector
        assert ds.synced
        api.delete(POOL_V1, "pool")
        await until(lambda: not ds.synced and len(ds) == 0)
        api.create(POOL_V1, pool_v1("pool", {"app": "v"}, [8001]))
        await until(lambda: ds.synced and names(ds) == {"a-rank-0"})


async def test_legacy_pool_group(api: KubeApi, tmp_path: Path) -> None:
    api.create(POOL_LEGACY, pool_legacy("pool", {"app": "v"}, 8000))
    api.create(POOL_V1, pool_v1("pool", {"app": "nothing"}, [1234]))  # same name, other group: ignored
    api.create(PODS, pod("a", {"app": "v"}, ip="10.0.0.1"))
    async with discovery(api, tmp_path, pool_group="inference.networking.x-k8s.io") as (_, ds):
        await until(lambda: ds.synced)
        assert [ep.key for ep in ds.snapshot()] == ["10.0.0.1:8000"]


async def test_an_invalid_pool_edit_keeps_the_last_valid_pool(api: KubeApi, tmp_path: Path) -> None:
    api.create(POOL_V1, pool_v1("pool", {"app": "v"}, [8000]))
    api.create(PODS, pod("a", {"app": "v"}, ip="10.0.0.1"))
    async with discovery(api, tmp_path) as (_, ds):
        await until(lambda: ds.synced and len(ds) == 1)
        api.wait_watching(POOL_V1, PODS)
        api.patch(POOL_V1, "pool", {"spec": {"targetPorts": [{"number": 0}]}})
        api.create(PODS, pod("b", {"app": "v"}, ip="10.0.0.2"))
        await until(lambda: len(ds) == 2)  # still served with port 8000
        assert {ep.port for ep in ds.snapshot()} == {8000}


async def test_objective_priorities(api: KubeApi, tmp_path: Path) -> None:
    api.create(POOL_V1, pool_v1("pool", {"app": "v"}, [8000]))
    api.create(OBJECTIVES, objective("batch", "pool", -1))
    api.create(OBJECTIVES, objective("chat", "pool", 10))
    api.create(OBJECTIVES, objective("foreign", "other-pool", 99))
    async with discovery(api, tmp_path) as (d, _):
        await until(lambda: d.priority_of("batch") == -1 and d.priority_of("chat") == 10)
        api.wait_watching(OBJECTIVES)
        assert d.priority_of("foreign") == 0 and d.priority_of("unknown") == 0 and d.priority_of("") == 0
        api.patch(OBJECTIVES, "batch", {"spec": {"priority": 3}})
        await until(lambda: d.priority_of("batch") == 3)
        api.delete(OBJECTIVES, "chat")
        await until(lambda: d.priority_of("chat") == 0)


async def test_api_down_at_start_keeps_not_ready_until_it_is_up(tmp_path: Path) -> None:
    with KubeApi() as api:
        async with discovery(api, tmp_path) as (d, ds):
            await until(lambda: d.pool_watch is not None and d.pool_watch.failures >= 2)  # tried twice, refused
            assert not ds.synced and len(ds) == 0
            api.start()
            api.create(POOL_V1, pool_v1("pool", {"app": "v"}, [8000]))
            api.create(PODS, pod("a", {"app": "v"}, ip="10.0.0.1"))
            took = await until(lambda: ds.synced and len(ds) == 1, timeout=15)
            assert took < 5.0  # backoff capped at 0.3 s here (uncapped, retries would be seconds apart)


async def test_stop_joins_the_watch_threads(api: KubeApi, tmp_path: Path) -> None:
    api.create(POOL_V1, pool_v1("pool", {"app": "v"}, [8000]))
    before = {t.name for t in threading.enumerate()}
    async with discovery(api, tmp_path) as (_, ds):
        await until(lambda: ds.synced)
        await until(lambda: "watch-inferenceobjectives.inference.networking.x-k8s.io" in {
            t.name for t in threading.enumerate()})
        assert {"watch-inferencepools", "watch-pods"} <= {t.name for t in threading.enumerate()}
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 3.0  # bounded by stop_timeout_s (2 s)
    assert {t.name for t in threading.enumerate() if t.name.startswith(("watch-", "probe-"))} <= before


def test_namespace_falls_back_to_env_then_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NAMESPACE", raising=False)
    assert pool_namespace(EppConfig(pool_name="p")) == "default"
    monkeypatch.setenv("NAMESPACE", "ml")
    assert pool_namespace(EppConfig(pool_name="p")) == "ml"
    assert pool_namespace(EppConfig(pool_name="p", pool_namespace="explicit")) == "explicit"


async def test_a_kv_events_annotation_naming_another_host_is_refused_logged_once_and_counted(
        api: KubeApi, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    api.create(POOL_V1, pool_v1("pool", {"app": "v"}, [8000]))
    hostile = pod("a", {"app": "v"}, ip="10.0.0.1")
    hostile["metadata"]["annotations"] = {"prefix-epp.io/kv-events-endpoint": "tcp://10.0.0.2:5557"}
    api.create(PODS, hostile)
    with caplog.at_level("WARNING", logger="prefix_epp.discovery"):
        async with discovery(api, tmp_path) as (d, ds):
            await until(lambda: names(ds) == {"a-rank-0"})
            api.wait_watching(PODS)
            ep = ds.snapshot()[0]
            # The picker would subscribe at the pod's own address, never at the one annotated.
            assert ep.spec.kv_events_endpoint == ""
            assert [a.events for a in source_addresses(ep, EppConfig().kv_events)] == ["tcp://10.0.0.1:5557"]
            api.patch(PODS, "a", {"metadata": {"labels": {"app": "v", "touched": "1"}}})  # same annotation
            await until(lambda: dict(ds.snapshot()[0].spec.labels).get("touched") == "1")
            assert d.refused_annotations == 1
            samples = {s.labels["annotation"]: s.value for m in DiscoveryCollector(d).collect() for s in m.samples}
            assert samples == {"prefix-epp.io/kv-events-endpoint": 1}
            api.patch(PODS, "a", {"metadata": {"annotations": {"prefix-epp.io/kv-events-endpoint": "6000"}}})
            await until(lambda: ds.snapshot()[0].spec.kv_events_endpoint == "tcp://10.0.0.1:6000")  # its own port
    assert d.refused_annotations == 1
    assert sum("annotation refused" in r.getMessage() for r in caplog.records) == 1
