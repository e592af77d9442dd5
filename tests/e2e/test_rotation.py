"""Failing replicas out of rotation, through real Envoy configured by `prefix-epp envoy-config`
(extproc/control/health.py): a replica with nothing listening, one answering 500 to every request
with healthy-looking /metrics, and the outcome metric counting what the client got."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.server import run_replicas
from testkit.envoy import run_envoy
from testkit.picker import Picker, picker_for, until, value
from testkit.procs import free_port

pytestmark = pytest.mark.e2e

SIM = SimConfig(time_scale=20.0, kv_events=False)


@contextlib.asynccontextmanager
async def path(tmp: Path, endpoints: list[str], *picker_args: str, envoy_endpoints: bool = False,
               max_endpoints: int = 1) -> AsyncIterator[tuple[Picker, str]]:
    picker = picker_for(tmp, endpoints, "--max-endpoints", str(max_endpoints), *picker_args)
    await asyncio.to_thread(picker.start)  # the simulated engines keep running in this loop meanwhile
    try:
        with contextlib.ExitStack() as stack:
            _, listen, _ = await asyncio.to_thread(
                stack.enter_context,
                run_envoy(tmp, picker.grpc_port, endpoints=tuple(endpoints) if envoy_endpoints else (),
                          max_endpoints=max_endpoints))
            yield picker, f"http://127.0.0.1:{listen}/v1/completions"
    finally:
        await asyncio.to_thread(picker.stop)


async def send(url: str, n: int, prompt: str = "You are a helpful assistant. ") -> list[tuple[int, str]]:
    """`n` requests one after another: (status, x-served-by) each."""
    out = []
    async with aiohttp.ClientSession() as s:
        for i in range(n):
            body = {"model": "sim-model", "prompt": f"{prompt}question {i}", "max_tokens": 4}
            async with s.post(url, json=body) as resp:
                await resp.read()
                out.append((resp.status, resp.headers.get("x-served-by", "")))
    return out


SCHEDULERS = ("predicted-ttft", "weighted", "cache-aware")


@pytest.mark.parametrize("scheduler", SCHEDULERS)
async def test_a_replica_with_nothing_listening_takes_no_request_once_its_scrape_failed(
        tmp_path: Path, scheduler: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    async with run_replicas(SIM, 1, base_port=0) as reps:
        live = f"127.0.0.1:{reps[0].port}"
        async with path(tmp_path, [live, dead], "--scheduler", scheduler) as (picker, url):
            await until(picker, lambda m: value(m, "prefix_epp_endpoint_in_rotation", endpoint=dead) == 0
                        and value(m, "prefix_epp_endpoint_in_rotation", endpoint=live) == 1)
            results = await send(url, 16)
            assert results == [(200, live)] * 16
            after = await until(picker, lambda m: value(m, "prefix_epp_requests_total",
                                                        outcome="routed", status="200") == 16)
            assert value(after, "prefix_epp_fail_open_decisions_total") == 0


async def test_every_replica_failing_routes_by_load_and_says_so(tmp_path: Path) -> None:
    dead = [f"127.0.0.1:{p}" for p in (free_port(), free_port())]
    async with path(tmp_path, dead) as (picker, url):
        await until(picker, lambda m: all(value(m, "prefix_epp_endpoint_in_rotation", endpoint=d) == 0 for d in dead))
        results = await send(url, 4)
        assert [status for status, _ in results] == [503] * 4  # Envoy could not connect: the client got 503
        after = await until(picker, lambda m: value(m, "prefix_epp_requests_total",
                                                    outcome="routed", status="503") == 4)
        assert value(after, "prefix_epp_fail_open_decisions_total") == 4
        assert value(after, "prefix_epp_requests_total", outcome="routed", status="200") == 0
    assert "every candidate endpoint is failing" in picker.log.read_text()


@pytest.mark.parametrize("scheduler", SCHEDULERS)
async def test_a_replica_answering_500_is_ejected_after_a_handful(tmp_path: Path, scheduler: str) -> None:
    async with run_replicas(SIM, 1, base_port=0) as good, \
            run_replicas(SimConfig(time_scale=20.0, kv_events=False, failure_rate=1.0), 1, base_port=0) as bad:
        ok, failing = f"127.0.0.1:{good[0].port}", f"127.0.0.1:{bad[0].port}"
        async with path(tmp_path, [failing, ok], "--outlier-ejection-time", "60s",
                        "--scheduler", scheduler) as (picker, url):
            await until(picker, lambda m: value(m, "prefix_epp_endpoint_in_rotation", endpoint=ok) == 1
                        and value(m, "prefix_epp_endpoint_in_rotation", endpoint=failing) == 1)
            results = await send(url, 40)
            errors = [r for r in results if r[0] != 200]
            # Three failures in a row eject it (--outlier-consecutive-failures 3); its fast errors
            # taught the scheduler nothing, so they could not draw more requests to it.
            assert 1 <= len(errors) <= 3, results
            assert all(status == 500 and served == failing for status, served in errors)
            assert results[-20:] == [(200, ok)] * 20
            after = await until(picker, lambda m: value(m, "prefix_epp_requests_total", outcome="routed",
                                                        status="500") == len(errors))
            assert value(after, "prefix_epp_requests_total", outcome="routed", status="200") == 40 - len(errors)
            assert value(after, "prefix_epp_endpoint_ejections_total") == 1
            assert value(after, "prefix_epp_endpoint_in_rotation", endpoint=failing) == 0
    assert "endpoint ejected after failed responses" in picker.log.read_text()


async def test_with_fallbacks_no_500_reaches_a_client_and_the_first_choice_is_still_ejected(tmp_path: Path) -> None:
    async with run_replicas(SIM, 1, base_port=0) as good, \
            run_replicas(SimConfig(time_scale=20.0, kv_events=False, failure_rate=1.0), 1, base_port=0) as bad:
        ok, failing = f"127.0.0.1:{good[0].port}", f"127.0.0.1:{bad[0].port}"
        async with path(tmp_path, [failing, ok], "--outlier-ejection-time", "60s", envoy_endpoints=True,
                        max_endpoints=2) as (picker, url):
            await until(picker, lambda m: value(m, "prefix_epp_endpoint_in_rotation", endpoint=failing) == 1)
            results = await send(url, 30)
            assert results == [(200, ok)] * 30  # a 500 from the first choice is retried on the second
            after = await until(picker, lambda m: value(m, "prefix_epp_endpoint_ejections_total") == 1)
            assert value(after, "prefix_epp_endpoint_in_rotation", endpoint=failing) == 0
