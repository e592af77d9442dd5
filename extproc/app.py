"""Wiring of one picker process: datastore, prefix index, scheduler, director, metrics, servers.

Construction is explicit: every component is created here and handed what it reads, so nothing
creates its own dependencies behind the caller's back.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import grpc

from extproc.config import EppConfig
from extproc.datastore import Datastore, Endpoint
from extproc.director import Director
from extproc.discovery.static import load_static
from extproc.metrics.epp import EppMetrics
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.build import default_scheduler
from extproc.scheduling.scheduler import Scheduler
from extproc.server.grpc_server import start_servers
from extproc.server.health import HealthServicer

log = logging.getLogger("prefix_epp")


@dataclass
class App:
    config: EppConfig
    datastore: Datastore = field(default_factory=Datastore)
    index: PrefixIndex = field(init=False)
    scheduler: Scheduler = field(init=False)
    director: Director = field(init=False)
    metrics: EppMetrics = field(init=False)
    health: HealthServicer = field(init=False)
    background: list[asyncio.Task[Any]] = field(default_factory=list)
    _servers: list[grpc.aio.Server] = field(default_factory=list)
    _metrics_server: Any = None

    def __post_init__(self) -> None:
        self.index = PrefixIndex(self.config.prefix.lru_capacity_per_server)
        self.datastore.on_removed(self._forget)
        self.scheduler = default_scheduler(self.config, self.index)
        self.director = Director(self.config, self.datastore, self.scheduler)
        self.metrics = EppMetrics(self.datastore, self.index, self.config.pool_name)
        self.health = HealthServicer(lambda: self.datastore.synced)

    def _forget(self, ep: Endpoint) -> None:
        self.index.remove_endpoint(ep.key)

    async def start(self) -> None:
        cfg = self.config
        if cfg.endpoints:
            load_static(self.datastore, cfg.endpoints)
        ext, hs = await start_servers(
            self.director, self.metrics, self.health, bind=cfg.bind_address, grpc_port=cfg.grpc_port,
            health_port=cfg.grpc_health_port, secure=cfg.secure_serving, cert_path=cfg.cert_path,
            explain=cfg.explain_decisions,
        )
        self._servers = [ext, hs]
        if cfg.metrics_port:
            from prometheus_client import start_http_server

            self._metrics_server = start_http_server(cfg.metrics_port, cfg.bind_address, self.metrics.registry)
        log.info("picker started", extra={
            "grpc_port": cfg.grpc_port, "health_port": cfg.grpc_health_port, "metrics_port": cfg.metrics_port,
            "secure_serving": cfg.secure_serving, "endpoints": len(self.datastore),
        })

    async def stop(self, grace: float = 2.0) -> None:
        self.health.shutting_down = True
        for task in self.background:
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        await asyncio.gather(*(s.stop(grace) for s in self._servers), return_exceptions=True)
        if self._metrics_server is not None:
            server = self._metrics_server[0] if isinstance(self._metrics_server, tuple) else self._metrics_server
            server.shutdown()
