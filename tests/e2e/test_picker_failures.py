"""The picker's own failures through real Envoy configured by `prefix-epp envoy-config` (fail open,
its default): a crash cuts no generation already routed, and SIGTERM under traffic drains
(extproc/transport/streams.py): routed streams finish, new ones stop once the readiness delay is
over, and the exit status says whether the drain timeout cut anything."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.server import run_replicas
from testkit.envoy import run_envoy
from testkit.picker import Picker, picker_for

pytestmark = pytest.mark.e2e

# 8 ms decode steps: a 150-token stream lasts ~1.2 s.
SIM = SimConfig(time_scale=1.0, kv_events=False)


@contextlib.asynccontextmanager
async def path(tmp: Path, *picker_args: str) -> AsyncIterator[tuple[Picker, str, list[str]]]:
    async with run_replicas(SIM, 2, base_port=0) as reps:
        endpoints = [f"127.0.0.1:{r.port}" for r in reps]
        picker = picker_for(tmp, endpoints, "--max-endpoints", "2", *picker_args)
        await asyncio.to_thread(picker.start)
        try:
            with contextlib.ExitStack() as stack:
                _, listen, _ = await asyncio.to_thread(
                    stack.enter_context,
                    run_envoy(tmp, picker.grpc_port, endpoints=tuple(endpoints), max_endpoints=2,
                              failure_mode_allow=True))
                yield picker, f"http://127.0.0.1:{listen}/v1/completions", endpoints
        finally:
            await asyncio.to_thread(picker.stop)


async def stream(s: aiohttp.ClientSession, url: str, i: int, tokens: int = 150,
                 started: asyncio.Event | None = None) -> tuple[int, bool]:
    """One streamed completion: (status, whether it ended with data: [DONE])."""
    body = {"model": "sim-model", "prompt": f"Tell story number {i}. " * 10, "max_tokens": tokens, "stream": True}
    last = b""
    async with s.post(url, json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: "):
                last = line[6:].strip()
                if started is not None:
                    started.set()
        return resp.status, last == b"[DONE]"


def exit_status(picker: Picker, timeout: float) -> int | None:
    assert picker.proc is not None
    try:
        return picker.proc.popen.wait(timeout=timeout)
    except Exception:
        return None


async def test_a_picker_crash_cuts_no_routed_generation(tmp_path: Path) -> None:
    async with path(tmp_path) as (picker, url, endpoints), aiohttp.ClientSession() as s:
        events = [asyncio.Event() for _ in range(4)]
        streams = [asyncio.create_task(stream(s, url, i, started=e)) for i, e in enumerate(events)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 10)
        assert picker.proc is not None
        os.kill(picker.proc.pid, signal.SIGKILL)  # mid-generation
        assert await asyncio.gather(*streams) == [(200, True)] * 4
        # The picker is gone: a new request goes on unsteered (round robin over --endpoints).
        body = {"model": "sim-model", "prompt": "Hello", "max_tokens": 2}
        async with s.post(url, json=body) as resp:
            assert resp.status == 200 and resp.headers["x-served-by"] in endpoints


async def test_sigterm_under_steady_traffic_drains_and_exits_cleanly(tmp_path: Path) -> None:
    async with path(tmp_path, "--drain-readiness-delay", "1s", "--drain-timeout", "20s") as (picker, url, _), \
            aiohttp.ClientSession() as s:
        results: list[tuple[int, bool]] = []
        stop = asyncio.Event()

        async def client(c: int) -> None:
            i = 0
            while not stop.is_set():
                results.append(await stream(s, url, 100 * c + i, tokens=60))
                i += 1

        clients = [asyncio.create_task(client(c)) for c in range(3)]
        while len(results) < 3:
            await asyncio.sleep(0.05)
        assert picker.proc is not None
        sent = time.monotonic()
        os.kill(picker.proc.pid, signal.SIGTERM)
        rc = await asyncio.to_thread(exit_status, picker, 20.0)
        took = time.monotonic() - sent
        stop.set()
        await asyncio.gather(*clients)
        log = picker.log.read_text()
        assert rc == 0, log[-3000:]
        # The readiness delay (1 s), then the streams open at that moment (~0.5 s each) finished.
        assert 1.0 <= took < 6.0, took
        assert "ext_proc port closed to new streams" in log and "drain cut open streams" not in log
        assert all(r == (200, True) for r in results), results  # nothing failed nor was cut


async def test_a_drain_timeout_that_cuts_streams_exits_1_with_a_warning(tmp_path: Path) -> None:
    async with path(tmp_path, "--drain-readiness-delay", "0", "--drain-timeout", "1s") as (picker, url, _), \
            aiohttp.ClientSession() as s:
        started = asyncio.Event()
        long = asyncio.create_task(stream(s, url, 1, tokens=500, started=started))  # ~4 s
        await asyncio.wait_for(started.wait(), 10)
        assert picker.proc is not None
        os.kill(picker.proc.pid, signal.SIGTERM)
        rc = await asyncio.to_thread(exit_status, picker, 10.0)
        log = picker.log.read_text()
        assert rc == 1, log[-3000:]
        assert "drain cut open streams" in log and '"cut_streams":1' in log
        assert await long == (200, True)  # fail open: the client's generation still ran to its end
