"""Wiring of one picker process: datastore, prefix index, scheduler, director, metrics, servers.

Construction is explicit: every component is created here and handed what it reads, so nothing
creates its own dependencies behind the caller's back.

Peer sync (extproc/sync/, `--sync-port`) is reached by the request path only through the index
listeners registered here; readiness waits for discovery and for the warm start. Stopping is two
steps: `drain()` (readiness NOT_SERVING, the ext_proc port closed after the readiness delay, open
streams finish, extproc/transport/streams.py), then `stop()`.

What runs where: everything runs on one asyncio event loop (the gRPC servers, the background
loops, /metrics collection), so the datastore and indexes need no locks. Only the Kubernetes
watches read their HTTP streams on threads and hand events to the loop (extproc/discovery/).
Background loops run supervised (extproc/core/background.py): a crash is logged and the loop restarts.

`freeze_startup_heap` (called by `prefix-epp serve` once the App is built, before it starts)
collects once and moves everything start-up built (the imported modules, the components) into the
collector's permanent generation: it lives as long as the process, and a full collection no longer
walks it on the request path (unfrozen, ~59k objects: each gen-2 pass held the loop 12-21 ms).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from extproc.config.settings import EppConfig, ProxyTrafficConfig
from extproc.config.validate import StartupError, bind_message
from extproc.control.director import Director
from extproc.control.health import Rotation
from extproc.core.background import Supervised, supervise
from extproc.core.datastore import Datastore, Endpoint
from extproc.discovery.static import load_static
from extproc.flowcontrol.controller import FlowController
from extproc.flowcontrol.detectors import make_detector
from extproc.kvevents.manager import KVEventsManager, kv_events_wanted, precise_routing
from extproc.prefix.index import PrefixIndex
from extproc.runtime.workers import WorkerRole
from extproc.scheduling.build import Profile, build_scheduler, default_profile
from extproc.scheduling.config_loader import load_config
from extproc.scheduling.saturation import UtilizationDetector
from extproc.scheduling.scheduler import Scheduler
from extproc.scheduling.scorers.predicted_ttft import PredictedTtftScorer
from extproc.scraping.scraper import MetricsScraper
from extproc.telemetry.epp import EppMetrics
from extproc.telemetry.flow_control import FlowControlMetrics
from extproc.telemetry.http import start_metrics_server
from extproc.telemetry.kv_events import KVEventsCollector
from extproc.telemetry.latency import LatencyCollector
from extproc.telemetry.rotation import RotationCollector
from extproc.tokenization.factory import Tokenizer, make_tokenizer
from extproc.transport.body_budget import BodyBudget
from extproc.transport.grpc_server import start_servers
from extproc.transport.health import HealthServicer
from extproc.transport.streams import StreamTracker

if TYPE_CHECKING:
    from extproc.discovery.kubernetes import KubernetesDiscovery
    from extproc.sync.kube_peers import PeerPods
    from extproc.sync.manager import PeerSync

log = logging.getLogger("prefix_epp")


def _set(event: asyncio.Event | None) -> bool:
    return event is not None and event.is_set()


def freeze_startup_heap() -> int:
    """Collect, then exempt every object alive now from later collections; returns how many."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@dataclass
class App:
    config: EppConfig
    profile: Profile | None = None  # None: from --config-file/--config-text, else the default profile
    role: WorkerRole = field(default_factory=WorkerRole)  # which worker of the pod (extproc/runtime/workers.py)
    datastore: Datastore = field(default_factory=Datastore)
    index: PrefixIndex = field(init=False)
    scheduler: Scheduler = field(init=False)
    director: Director = field(init=False)
    metrics: EppMetrics = field(init=False)
    health: HealthServicer = field(init=False)
    body_budget: BodyBudget = field(init=False)  # buffered request bytes of all streams
    detector: UtilizationDetector = field(init=False)
    flow: FlowController | None = field(init=False, default=None)  # flow control (its feature gate)
    discovery: KubernetesDiscovery | None = field(init=False, default=None)
    scraper: MetricsScraper | None = field(init=False, default=None)
    kv_events: KVEventsManager | None = field(init=False, default=None)  # precise index (extproc/kvevents/)
    tokenizer: Tokenizer | None = field(init=False, default=None)
    sync: PeerSync | None = field(init=False, default=None)  # peer sync (extproc/sync/)
    peer_pods: PeerPods | None = field(init=False, default=None)
    streams: StreamTracker = field(default_factory=StreamTracker)
    background: list[asyncio.Task[Any]] = field(default_factory=list)
    supervised: list[Supervised] = field(default_factory=list)
    _servers: list[grpc.aio.Server] = field(default_factory=list)
    _metrics_server: Any = None

    def __post_init__(self) -> None:
        if self.profile is None:
            self.config, self.profile = load_config(self.config)
        cfg = self.config
        self.index = PrefixIndex(cfg.prefix.lru_capacity_per_server)
        self.datastore.on_removed(self._forget)
        self.datastore.on_restarted(lambda ep: self.index.clear_endpoint(ep.key))
        scorer_types = (self.profile or default_profile(cfg)).scorer_types()
        if kv_events_wanted(cfg.kv_events, scorer_types):
            self.kv_events = KVEventsManager(cfg.kv_events, self.datastore)
            self.tokenizer = make_tokenizer(cfg.kv_events.tokenizer, self.datastore, cfg.kv_events.tokenize_timeout_s)
        self.scheduler = build_scheduler(cfg, self.index, self.profile, precise=self.kv_events)
        self.detector = UtilizationDetector(cfg.saturation)
        if cfg.pool_name:
            from extproc.discovery.kubernetes import KubernetesDiscovery  # imports the kubernetes client

            self.discovery = KubernetesDiscovery(cfg, self.datastore)
        if cfg.refresh_metrics_interval_s > 0:
            self.scraper = MetricsScraper(cfg, self.datastore, self.index)
        self.rotation = Rotation(cfg.outlier, self.datastore)
        if cfg.flow_control.enabled:  # it admits instead of the detector's 429 for sheddable requests
            timeout = ProxyTrafficConfig().ext_proc_message_timeout_s
            for name in cfg.flow_control.ttl_beyond(timeout):
                log.warning("a flow-control TTL is not below the proxy's ext_proc message timeout: a request held "
                            "that long gets the proxy's 504; raise the proxy's timeout (docs/flow-control.md)",
                            extra={"field": name, "message_timeout_s": timeout})
            if cfg.flow_control.detector == "utilization-detector" and cfg.refresh_metrics_interval_s <= 0:
                log.warning("flow control's utilization-detector reads the engines' scrapes, and scraping is off "
                            "(--refresh-metrics-interval 0): every endpoint counts as saturated, nothing is "
                            "dispatched; use concurrency-detector or turn scraping on")
            self.flow = FlowController(cfg.flow_control, self.datastore, make_detector(cfg.flow_control,
                                                                                       cfg.saturation))
        self.director = Director(cfg, self.datastore, self.scheduler,
                                 admission=self.detector.admit if self.flow is None else None,
                                 priority_of=self.discovery.priority_of if self.discovery else None,
                                 precise=self.kv_events, tokenizer=self.tokenizer,
                                 routes_on_tokens=precise_routing(cfg.kv_events, scorer_types),
                                 rotation=self.rotation)
        self.metrics = EppMetrics(self.datastore, self.index, cfg.pool_name, cfg.metrics_staleness_threshold_s,
                                  cfg.model_names)
        self.metrics.registry.register(RotationCollector(self.rotation, self.datastore))
        if self.scraper is not None:
            self.scraper.on_models = self.metrics.models.learn  # engines' model names keep their label
        self.director.feedback = self.metrics.observe_usage  # closed loop (extproc/control/usage.py)
        if self.flow is not None:
            self.director.flow = self.flow
            self.flow.observer = FlowControlMetrics(self.metrics.registry, self.flow)
        if self.kv_events is not None:
            self.metrics.registry.register(KVEventsCollector(self.kv_events))
        if self.discovery is not None:
            from extproc.telemetry.discovery import DiscoveryCollector  # imports the kubernetes client

            self.metrics.registry.register(DiscoveryCollector(self.discovery))
        for observer in self.scheduler.observers:
            if isinstance(observer, PredictedTtftScorer):
                self.metrics.registry.register(LatencyCollector(observer.model))
        if cfg.sync.port or self.role.count > 1:
            self._wire_sync()
        if self.scraper is not None and self.sync is not None:
            sync, workers = self.sync, self.role.count  # every pod runs as many workers as this one
            self.scraper.scrapers = lambda: (1 + sync.connected_peers()) * workers
        self.health = HealthServicer(self._ready, cfg.max_health_watches)
        self.body_budget = BodyBudget(cfg.max_buffered_bytes)

    def _wire_sync(self) -> None:
        from extproc.sync.manager import PeerSync, load_secret
        from extproc.telemetry.sync import SyncCollector

        cfg = self.config
        server_creds, peer_creds = None, None
        if cfg.sync.tls:
            from extproc.sync.link import PeerCredentials
            from extproc.transport.tls import peer_tls

            server_creds, channel_creds, server_name = peer_tls(cfg.cert_path)
            peer_creds = PeerCredentials(channel_creds, server_name)
        sync = self.sync = PeerSync(cfg.sync, load_secret(cfg.sync), self.index, self.kv_events,
                                    datastore=self.datastore, bind=cfg.listen_address("sync"),
                                    reuse_port=self.role.count > 1, sibling_port=self.role.sibling_port,
                                    siblings=self.role.siblings, server_credentials=server_creds,
                                    peer_credentials=peer_creds)
        self.index.on_record(sync.outbox.record)
        if self.kv_events is not None:
            self.kv_events.on_record(sync.outbox.speculative)
        self.datastore.on_removed(lambda ep: sync.outbox.removed(ep.key))
        self.metrics.registry.register(SyncCollector(sync))
        if cfg.sync.peer_selector:
            from extproc.sync.kube_peers import PeerPods

            self.peer_pods = PeerPods(cfg, sync.set_peers)

    def _ready(self) -> bool:
        return self.datastore.synced and (self.sync is None or self.sync.warm)

    def _forget(self, ep: Endpoint) -> None:
        self.index.remove_endpoint(ep.key)

    async def start(self) -> None:
        cfg = self.config
        if cfg.endpoints:
            load_static(self.datastore, cfg.endpoints, cfg.endpoint_roles)
        if self.discovery is not None:
            self._supervise("discovery", self.discovery.run)
        if self.scraper is not None:
            self._supervise("metrics-scraper", self.scraper.run)
        if self.kv_events is not None:
            self._supervise("kv-events", self.kv_events.run)
        if self.sync is not None:
            await self.sync.start()
            if self.peer_pods is not None:
                self._supervise("peer-pods", self.peer_pods.run)
            self.background.append(asyncio.create_task(self.sync.warm_start(), name="warm-start"))
        first = self.role.index == 0
        # /metrics first: once the health port answers, every port the pod declares does.
        if cfg.metrics_port:
            from extproc.telemetry.pod import pod_renderer

            if not first:  # read by worker 0 only (extproc/telemetry/pod.py)
                self._metrics_server = await start_metrics_server(self.metrics.registry, "127.0.0.1",
                                                                  self.role.metrics_port)
            else:
                render = (pod_renderer(self.metrics.registry, self.role.sibling_metrics) if self.role.count > 1
                          else None)
                address = cfg.listen_address("metrics")
                try:
                    self._metrics_server = await start_metrics_server(self.metrics.registry, address,
                                                                      cfg.metrics_port, render)
                except OSError as exc:  # taken since `serve` checked it (extproc/commands/preflight.py)
                    raise StartupError(bind_message("--metrics-port", "--metrics-bind-address", address,
                                                    cfg.metrics_port, exc)) from None
        self._servers = await start_servers(
            self.director, self.metrics, self.health, bind=cfg.bind_address, grpc_port=cfg.grpc_port,
            health_port=cfg.grpc_health_port if first else 0, health_bind=cfg.listen_address("health"),
            secure=cfg.secure_serving, cert_path=cfg.cert_path, explain=cfg.explain_decisions, streams=self.streams,
            reuse_port=self.role.count > 1, budget=self.body_budget, client_ca_file=cfg.client_ca_file,
        )
        log.info("picker started", extra={
            "grpc_port": cfg.grpc_port, "health_port": cfg.grpc_health_port, "metrics_port": cfg.metrics_port,
            "secure_serving": cfg.secure_serving, "client_auth": bool(cfg.client_ca_file),
            "endpoints": len(self.datastore),
            "worker": self.role.index, "workers": self.role.count,
        })

    async def drain(self, interrupt: asyncio.Event | None = None) -> int:
        """Readiness NOT_SERVING at once; new streams taken for the readiness delay (less if none
        comes); then the ext_proc port closes and the open streams finish. Returns how many the
        drain timeout (or `interrupt`) cut: 0 is a clean stop (extproc/transport/streams.py)."""
        self.health.shutting_down = True
        d = self.config.drain
        streams = self.streams
        start = time.monotonic()
        log.info("draining", extra={"open_streams": streams.open, "timeout_s": d.timeout_s,
                                    "readiness_delay_s": d.readiness_delay_s})
        delay = min(d.readiness_delay_s, d.timeout_s / 2)  # at least half the timeout left for open streams
        if not await streams.drained(d.idle_s, delay, interrupt) and not _set(interrupt):
            left = max(0.0, d.timeout_s - (time.monotonic() - start))
            closing = [asyncio.ensure_future(s.stop(left)) for s in self._servers[:1]]  # the ext_proc port
            log.info("ext_proc port closed to new streams", extra={"open_streams": streams.open})
            await streams.drained(0.0, left, interrupt)
            cut = streams.open
            for task in closing:
                task.cancel()
        else:
            cut = streams.open
        if cut:
            log.warning("drain cut open streams", extra={"cut_streams": cut, "timeout_s": d.timeout_s,
                                                        "interrupted": _set(interrupt)})
        else:
            log.info("drained", extra={"elapsed_s": round(time.monotonic() - start, 3)})
        return cut

    def _supervise(self, name: str, run: Callable[[], Awaitable[object]]) -> None:
        sup = supervise(name, run)
        self.supervised.append(sup)
        self.background.append(sup.task)

    async def stop(self, grace: float = 1.0) -> None:
        self.health.shutting_down = True
        for task in self.background:
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        if self.flow is not None:
            await self.flow.close()  # held requests get 503 before the servers stop
        await self.director.close()
        if self.tokenizer is not None:
            await self.tokenizer.close()
        await asyncio.gather(*(s.stop(grace) for s in self._servers), return_exceptions=True)
        if self.sync is not None:
            await self.sync.stop()
        if self._metrics_server is not None:
            await self._metrics_server.cleanup()
