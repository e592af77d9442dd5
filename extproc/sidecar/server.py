"""The sidecar's process: its listeners, its outbound pool, start and graceful stop.

`Sidecar(config)` serves `Proxy.handle` (extproc/sidecar/proxy.py) for every method and path on
`bind_address:port` (TLS with `secure_serving`, from `cert_path`/tls.crt and tls.key), and its own
/metrics on `metrics_port` when that is not 0. One aiohttp `ClientSession` carries both legs to
every engine (at most `max_connections` connections; answers are not decompressed, so bytes pass
through as the engine sent them, with its Content-Encoding).

`stop()` is the graceful stop a SIGTERM starts (`serve`): the listeners close at once (no new
connection is accepted), requests in flight get `shutdown_grace_s` to finish (a streamed answer
keeps streaming), then what is left is cut and the outbound pool closed. A second signal does not
wait for the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

from extproc.config.sidecar import SidecarConfig
from extproc.sidecar import protocol
from extproc.sidecar.metrics import SidecarMetrics
from extproc.sidecar.proxy import Proxy

log = logging.getLogger("prefix_epp.sidecar")


@web.middleware
async def json_errors(request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """aiohttp's own refusals (a body past client_max_size: 413) as OpenAI-style JSON errors."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.Response(status=exc.status, content_type="application/json",
                            body=orjson.dumps(protocol.error_body(exc.status, exc.reason)))


def server_tls(config: SidecarConfig) -> ssl.SSLContext | None:
    if not config.secure_serving:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    directory = Path(config.cert_path)
    ctx.load_cert_chain(directory / "tls.crt", directory / "tls.key")
    return ctx


class Sidecar:
    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.metrics = SidecarMetrics()
        self.port = config.port  # the bound port once started (the kernel's choice for 0)
        self.metrics_port = config.metrics_port
        self._session: aiohttp.ClientSession | None = None
        self._runners: list[web.AppRunner] = []

    async def start(self) -> None:
        cfg = self.config
        tls = server_tls(cfg)  # an unreadable certificate fails before anything listens
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=cfg.max_connections, limit_per_host=0),
            auto_decompress=False, skip_auto_headers=("Accept-Encoding", "Content-Type", "User-Agent"))
        proxy = Proxy(cfg, self._session, self.metrics)
        app = web.Application(client_max_size=cfg.max_request_body_bytes, middlewares=[json_errors])
        app.router.add_route("*", "/{tail:.*}", proxy.handle)
        try:
            self.port = await self._serve(app, cfg.port, tls)
            if cfg.metrics_port:
                metrics = web.Application()
                metrics.router.add_get("/metrics", self._metrics)
                self.metrics_port = await self._serve(metrics, cfg.metrics_port, None)
        except BaseException:
            await self.stop(grace=0)
            raise
        log.info("sidecar_started", extra={"port": self.port, "decode_url": cfg.decode_url,
                                           "kv_connector": cfg.kv_connector, "tls": tls is not None,
                                           "metrics_port": self.metrics_port or None})

    async def _serve(self, app: web.Application, port: int, tls: ssl.SSLContext | None) -> int:
        runner = web.AppRunner(app, access_log=None, handle_signals=False,
                               shutdown_timeout=self.config.shutdown_grace_s)
        self._runners.append(runner)
        await runner.setup()
        site = web.TCPSite(runner, self.config.bind_address, port, ssl_context=tls)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def stop(self, grace: float | None = None) -> None:
        """Close the listeners, let requests in flight finish within `grace` seconds (default
        `shutdown_grace_s`), then close the outbound pool."""
        for runner in self._runners:
            if grace is not None:
                runner._shutdown_timeout = grace  # aiohttp reads it at cleanup
            await runner.cleanup()
        self._runners = []
        if self._session is not None:
            await self._session.close()
            self._session = None


async def serve(config: SidecarConfig) -> int:
    """Run until SIGTERM or SIGINT, then stop gracefully (a second signal: at once)."""
    sidecar = Sidecar(config)
    await sidecar.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("sidecar_stopping", extra={"grace_s": config.shutdown_grace_s})
        stopping = asyncio.ensure_future(sidecar.stop())
        stop.clear()
        hurry = asyncio.ensure_future(stop.wait())
        await asyncio.wait({stopping, hurry}, return_when=asyncio.FIRST_COMPLETED)
        if not stopping.done():  # a second signal: cut what is left
            stopping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stopping
            await sidecar.stop(grace=0)
        hurry.cancel()
    finally:
        for sig in signals:
            with contextlib.suppress(NotImplementedError):
                loop.remove_signal_handler(sig)
    log.info("sidecar_stopped")
    return 0
