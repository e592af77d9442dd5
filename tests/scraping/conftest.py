"""The scraper tests' model servers: three `FakeEngine`s (testkit/vllm_stubs.py) on loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from testkit.procs import free_ports
from testkit.vllm_stubs import FakeEngine, serve_metrics
from testkit.vllm_text import exposition


@pytest.fixture
async def engines() -> AsyncIterator[dict[int, FakeEngine]]:
    """Three model servers on 127.0.0.1, each serving the /metrics page of its FakeEngine."""
    state: dict[int, FakeEngine] = {}
    runners = []
    for port in free_ports(3):
        engine = state[port] = FakeEngine(exposition(0, 0, 0.0))

        async def handle(_: web.Request, engine: FakeEngine = engine) -> web.Response:
            engine.arrivals.append(time.monotonic())
            if engine.delay:
                await asyncio.sleep(engine.delay)
            return web.Response(body=engine.body, status=engine.status, content_type="text/plain")

        runners.append(await serve_metrics(port, handle))
    yield state
    for runner in runners:
        await runner.cleanup()
