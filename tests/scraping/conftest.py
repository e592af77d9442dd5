"""Model servers on loopback for the scraper tests: `serve_metrics` answers GET /metrics with a
handler, and the `engines` fixture runs three `FakeEngine`s whose page, status and answer delay
a test sets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from testkit.procs import free_ports
from testkit.vllm_text import exposition


async def serve_metrics(port: int, handle: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.AppRunner:
    """GET /metrics on 127.0.0.1:`port` answered by `handle`; the runner to clean up."""
    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@dataclass
class FakeEngine:
    body: bytes
    status: int = 200
    delay: float = 0.0  # seconds before each answer (the engine rendering its page)
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() when each GET arrived

    @property
    def hits(self) -> int:
        return len(self.arrivals)


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
