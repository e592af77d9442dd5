"""InferenceObjectives from either API group (llm-d.ai, inference.networking.x-k8s.io), detected
at start-up against kmock; a missing CRD is logged once and probed again slowly."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from extproc.config.settings import DiscoveryConfig, EppConfig
from extproc.core.datastore import Datastore
from extproc.discovery.kubernetes import KubernetesDiscovery
from testkit.kube import OBJECTIVES, OBJECTIVES_LLMD, POOL_V1, KubeApi, objective, pool_v1

RECHECK_S = 0.4
FAST = DiscoveryConfig(backoff_initial_s=0.05, backoff_max_s=0.3, objective_recheck_interval_s=RECHECK_S)


@asynccontextmanager
async def discovery(api: KubeApi, tmp: Path) -> AsyncIterator[KubernetesDiscovery]:
    config = replace(EppConfig(), pool_name="pool", kubeconfig=str(api.write_kubeconfig(tmp / "kubeconfig")),
                     discovery=FAST)
    d = KubernetesDiscovery(config, Datastore())
    task = asyncio.create_task(d.run())
    try:
        yield d
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("apis", [(OBJECTIVES_LLMD,), (OBJECTIVES,)], ids=["llm-d.ai", "x-k8s.io"])
async def test_objectives_of_the_installed_group(tmp_path: Path, apis: tuple[tuple[str, str, str], ...]) -> None:
    with KubeApi(objectives=apis) as api:
        api.start()
        api.create(POOL_V1, pool_v1("pool", {"app": "v"}, [8000]))
        api.create(apis[0], objective("batch", "pool", -1, api=apis[0]))
        async with discovery(api, tmp_path) as d:
            await until(lambda: d.priority_of("batch") == -1)
            api.wait_watching(apis[0])  # kmock loses changes made between the LIST and the WATCH
            api.patch(apis[0], "batch", {"spec": {"priority": 4}})
            await until(lambda: d.priority_of("batch") == 4)


async def test_both_groups_are_read_and_llm_d_wins_a_name_clash(tmp_path: Path) -> None:
    with KubeApi(objectives=(OBJECTIVES, OBJECTIVES_LLMD)) as api:
        api.start()
        api.create(POOL_V1, pool_v1("pool", {"app": "v"}, [8000]))
        api.create(OBJECTIVES, objective("old-only", "pool", 7, api=OBJECTIVES))
        api.create(OBJECTIVES, objective("both", "pool", 1, api=OBJECTIVES))
        api.create(OBJECTIVES_LLMD, objective("both", "pool", 9, api=OBJECTIVES_LLMD))
        async with discovery(api, tmp_path) as d:
            await until(lambda: d.priority_of("old-only") == 7 and d.priority_of("both") == 9)
            api.wait_watching(OBJECTIVES, OBJECTIVES_LLMD)
            api.delete(OBJECTIVES_LLMD, "both")
            await until(lambda: d.priority_of("both") == 1)


async def test_missing_crd_logged_once_and_rechecked_slowly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="prefix_epp.discovery")
    with KubeApi(objectives=()) as api:
        api.start()
        api.create(POOL_V1, pool_v1("pool", {"app": "v"}, [8000]))
        async with discovery(api, tmp_path) as d:
            await until(lambda: d.objectives is not None and d.objectives.probes >= 2)
            t0 = time.monotonic()
            await asyncio.sleep(3 * RECHECK_S)  # let it run: count the probes in this window
            assert d.objectives is not None
            probes, elapsed = d.objectives.probes, time.monotonic() - t0 + RECHECK_S
            # Two groups per round, one round per recheck interval (a tight loop would make hundreds).
            assert probes <= 2 * (elapsed / RECHECK_S + 1), probes
            missing = [r for r in caplog.records if r.getMessage() == "InferenceObjective CRD not installed"]
            assert sorted(getattr(r, "group", "") for r in missing) == ["inference.networking.x-k8s.io", "llm-d.ai"]
            assert d.priority_of("anything") == 0
            # The CRD is installed later: found on the next probe, then watched.
            api.install_objective_api(OBJECTIVES_LLMD)
            api.create(OBJECTIVES_LLMD, objective("late", "pool", 3, api=OBJECTIVES_LLMD))
            await until(lambda: d.priority_of("late") == 3, timeout=RECHECK_S * 5)
        found = [r for r in caplog.records if r.getMessage() == "InferenceObjective API found; watching it"]
        assert [getattr(r, "group", "") for r in found] == ["llm-d.ai"]
        assert len([r for r in caplog.records if r.getMessage() == "InferenceObjective CRD not installed"]) == 2
