"""The prefill/decode sidecar in tests: served in the test's event loop, and an engine stand-in
that records what the sidecar sent it.

`sidecar(**fields)` runs `extproc.sidecar.server.Sidecar` on 127.0.0.1 and a free port with those
SidecarConfig fields. `Recorder(answer)` is an HTTP server on a free port (TLS with `tls`, a server
context) that keeps every request it receives (`seen`: method, path and query as sent, headers in
order, body bytes) and answers it with `answer(seen)`: what the simulator cannot show, the exact
bytes and headers each leg carries.
`sse_events(response)` reads a server-sent-events answer event by event, as a client does.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from extproc.config.sidecar import SidecarConfig
from extproc.sidecar.server import Sidecar


@contextlib.asynccontextmanager
async def sidecar(**fields: Any) -> AsyncIterator[Sidecar]:
    server = Sidecar(SidecarConfig(**{"port": 0, "bind_address": "127.0.0.1", **fields}))
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=0)


@dataclass
class Seen:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    request: Any = field(default=None, repr=False, compare=False)  # to answer it (a streamed answer)

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    def json(self) -> Any:
        return orjson.loads(self.body)


Answer = Callable[[Seen], Awaitable[web.StreamResponse]]


async def json_answer(seen: Seen, status: int = 200, body: Any = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body if body is not None else {"ok": True}),
                        content_type="application/json")


class Recorder:
    """An engine stand-in (module docstring); `url` once started."""

    def __init__(self, answer: Answer = json_answer, tls: ssl.SSLContext | None = None) -> None:
        self.answer = answer
        self.tls = tls
        self.seen: list[Seen] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def host_port(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        headers = [(k.decode(), v.decode()) for k, v in request.raw_headers]
        seen = Seen(request.method, request.raw_path, headers, await request.read(), request)
        self.seen.append(seen)
        return await self.answer(seen)

    async def __aenter__(self) -> Recorder:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.tls)
        await site.start()
        self.port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def sse_events(response: aiohttp.ClientResponse) -> AsyncGenerator[bytes, None]:
    """Each `data:` payload of a server-sent-events answer, as soon as its event is complete."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    yield line[len(b"data: "):]
