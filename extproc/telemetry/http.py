"""The /metrics endpoint, served on the event loop (aiohttp).

Collection runs on the loop that also mutates the datastore, the prefix index and the KV-event
state, so every collector reads a consistent state without locks; prometheus_client's own HTTP
server would collect on a separate thread while the loop writes. A scrape costs a few
milliseconds of loop time (a few hundred series).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


async def start_metrics_server(registry: CollectorRegistry, host: str, port: int,
                               render: Callable[[], Awaitable[bytes]] | None = None) -> web.AppRunner:
    """Serve `registry` (or what `render` returns: a multi-worker pod, extproc/telemetry/pod.py)."""

    async def metrics(_request: web.Request) -> web.Response:
        resp = web.Response(body=await render() if render is not None else generate_latest(registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
