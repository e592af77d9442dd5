"""Kubernetes peers: ready pods of our own Deployment, live, against kmock (extproc/sync/kube_peers.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from extproc.config.settings import DiscoveryConfig, EppConfig, SyncConfig
from extproc.sync.kube_peers import PeerPods, parse_selector
from testkit.kube import PODS, KubeApi, pod, ready_condition
from testkit.sync import until

OURS = {"app.kubernetes.io/name": "prefix-epp", "app.kubernetes.io/instance": "x"}


@pytest.fixture
def api() -> Iterator[KubeApi]:
    with KubeApi() as a:
        a.start()
        yield a


async def test_peers_follow_ready_pods_of_our_deployment(api: KubeApi, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "epp-self")
    api.create(PODS, pod("epp-self", OURS, ip="10.0.0.1"))
    api.create(PODS, pod("epp-a", OURS, ip="10.0.0.2"))
    api.create(PODS, pod("epp-starting", OURS, ip="10.0.0.3", ready=False))
    api.create(PODS, pod("vllm-0", {"app": "vllm"}, ip="10.0.0.9"))  # not a picker
    config = replace(EppConfig(), pool_name="pool", kubeconfig=str(api.write_kubeconfig(tmp_path / "kc")),
                     discovery=DiscoveryConfig(backoff_initial_s=0.05, backoff_max_s=0.3),
                     sync=replace(SyncConfig(), port=9005, peer_selector=",".join(f"{k}={v}" for k, v in OURS.items())))
    seen: list[list[str]] = []

    def set_peers(peers: Iterable[str]) -> None:
        seen.append(list(peers))

    pods = PeerPods(config, set_peers)
    task = asyncio.create_task(pods.run())
    try:
        await until(lambda: bool(seen) and seen[-1] == ["10.0.0.2:9005"])
        await asyncio.to_thread(api.wait_watching, PODS)
        api.patch(PODS, "epp-starting", {"status": {"conditions": [ready_condition(True)]}})  # scale up
        await until(lambda: seen[-1] == ["10.0.0.2:9005", "10.0.0.3:9005"])
        api.delete(PODS, "epp-a")  # scale down
        await until(lambda: seen[-1] == ["10.0.0.3:9005"])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_selector_parsing() -> None:
    assert parse_selector("a=b, c=d") == (("a", "b"), ("c", "d"))
    for bad in ("a", "a!=b", "a==b", ""):
        with pytest.raises(ValueError):
            parse_selector(bad)
