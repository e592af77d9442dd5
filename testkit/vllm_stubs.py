"""Model-server stubs with a vLLM /metrics page: `python -m testkit.vllm_stubs PORT ...`.

Each port serves:
- `GET /metrics`: a ~125 KB vLLM exposition (testkit/vllm_text.py) with the port's current
  waiting/running/KV values (regenerated only when they change); with `?name[]=...` only those
  samples, as prometheus_client's own exposition answers (vLLM 0.32's renders its whole page:
  docs/scheduling.md, "Load signals");
- `POST /control` with JSON `{"waiting": w, "running": r, "kv": k}`: sets those values;
- `POST /hold` with JSON `{"hold": true}`: requests (other than these three) wait unanswered until
  `{"hold": false}`, so a test keeps requests in flight for as long as it needs them;
- anything else: `{"served_by": "127.0.0.1:PORT", "usage": {...}}` with the `x-served-by` header,
  like testkit/echo_backends.py; the usage (what the picker's closed loop reads) counts a prompt
  token per 4 body bytes, none of them cached.
Used to measure the scraper's CPU cost in another process, and as load-reporting backends in
end-to-end tests.

In process, for the scraper's tests: `serve_metrics(port, handle)` answers GET /metrics with a
handler, and a `FakeEngine` holds the page, status and answer delay a test sets (the
tests/scraping `engines` fixture serves three).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from testkit.vllm_text import exposition, restrict


def make_app(name: str) -> web.Application:
    state = {"values": (2.0, 3.0, 0.3)}
    page = {"body": exposition(*state["values"], loras=[("a", "", 4, 1.0)])}
    released = asyncio.Event()
    released.set()

    async def metrics(request: web.Request) -> web.Response:
        names = request.query.getall("name[]", [])
        body = restrict(page["body"], frozenset(names)) if names else page["body"]
        return web.Response(body=body, content_type="text/plain")

    async def control(request: web.Request) -> web.Response:
        doc = orjson.loads(await request.read())
        state["values"] = (float(doc.get("waiting", 0)), float(doc.get("running", 0)), float(doc.get("kv", 0)))
        page["body"] = exposition(*state["values"], loras=[("a", "", 4, 1.0)])
        return web.json_response({"ok": True})

    async def hold(request: web.Request) -> web.Response:
        if orjson.loads(await request.read()).get("hold"):
            released.clear()
        else:
            released.set()
        return web.json_response({"ok": True})

    async def other(request: web.Request) -> web.Response:
        size = len(await request.read())
        await released.wait()
        usage = {"prompt_tokens": max(1, size // 4), "prompt_tokens_details": {"cached_tokens": 0}}
        return web.json_response({"served_by": name, "usage": usage}, headers={"x-served-by": name})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/control", control)
    app.router.add_post("/hold", hold)
    app.router.add_route("*", "/{tail:.*}", other)
    return app


async def serve(port: int, app: web.Application) -> web.AppRunner:
    """`app` on 127.0.0.1:`port`; the runner to clean up."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def serve_metrics(port: int, handle: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.AppRunner:
    """GET /metrics on 127.0.0.1:`port` answered by `handle`."""
    app = web.Application()
    app.router.add_get("/metrics", handle)
    return await serve(port, app)


@dataclass
class FakeEngine:
    """A model server's /metrics as a test drives it."""

    body: bytes
    status: int = 200
    delay: float = 0.0  # seconds before each answer (the engine rendering its page)
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() when each GET arrived

    @property
    def hits(self) -> int:
        return len(self.arrivals)


async def main(ports: list[int]) -> None:
    runners = [await serve(port, make_app(f"127.0.0.1:{port}")) for port in ports]
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    for runner in runners:
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main([int(p) for p in sys.argv[1:]]))
