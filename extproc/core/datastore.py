"""The datastore: the endpoints the picker may route to, their load and their scraped metrics.

Background tasks (discovery, metrics scraping) write it through explicit methods; the request path
only reads it and moves in-flight counters. Everything runs on one asyncio loop, so no locks:

- ext_proc streams (request path): read `snapshot`, `acquire`/`release`;
- static and Kubernetes discovery: `set_endpoints`, `upsert`, `remove` (the watch threads only
  read the API server and hand each event to the loop with `call_soon_threadsafe`);
- metrics scraper and KV-event manager: `set_metrics`, read `snapshot` (supervised tasks,
  extproc/core/background.py);
- /metrics collection: reads `snapshot` and the endpoints' counters (aiohttp on the loop,
  extproc/telemetry/http.py).

- `set_endpoints(specs)` replaces the whole set (static discovery, a full Kubernetes relist);
  `upsert`/`remove` apply single changes (watch events). Removal notifies listeners at once, which
  purge the endpoint from the prefix index, so the picker never routes to an endpoint it forgot.
- `snapshot()` returns an immutable tuple of the current endpoints, rebuilt only on change.
- `acquire(key)` / `release(key)` count requests the picker routed that have not completed.
- `changes` (extproc/core/changes.py, shared by every endpoint as `ep.changes`): the keys of the
  endpoints whose in-flight count or scrape changed, or that were added, in order; the queue
  ranking recomputes only those.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from extproc.core.changes import Changes

# llm-d's pod label for prefill/decode disaggregation: prefill, decode, prefill-decode (both: its
# deprecated alias; settings.ENDPOINT_ROLES); read by the role filters (extproc/scheduling/filters/roles.py).
ROLE_LABEL = "llm-d.ai/role"


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """What discovery knows about one endpoint (one pod IP and target port)."""

    address: str
    port: int
    name: str = ""
    namespace: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    kv_events_endpoint: str = ""
    # Data-parallel rank: the position of its port in the InferencePool's targetPorts (GIE names
    # the endpoint `<pod>-rank-<i>`); its engine publishes KV events on the pod's base port + rank
    # (extproc/kvevents/manager.py). 0 for static endpoints.
    rank: int = 0

    @property
    def key(self) -> str:
        return join_host_port(self.address, self.port)

    @property
    def role(self) -> str:
        """Its prefill/decode role: the pod label `llm-d.ai/role` (static endpoints: --endpoint-roles);
        "" when unlabelled."""
        for k, v in self.labels:
            if k == ROLE_LABEL:
                return v
        return ""


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(value: str) -> tuple[str, int]:
    """Parse `ip:port` or `[ipv6]:port`; raises ValueError on anything else."""
    value = value.strip()
    if value.startswith("["):
        host, sep, port = value[1:].partition("]:")
    else:
        host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a host:port endpoint: {value!r}")
    return host, int(port)


@dataclass(slots=True)
class ModelServerMetrics:
    """The last scrape of an endpoint's /metrics (vLLM names)."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    block_size: int = 0
    num_gpu_blocks: int = 0
    running_loras: frozenset[str] = frozenset()
    waiting_loras: frozenset[str] = frozenset()
    max_lora: int = 0
    model_names: frozenset[str] = frozenset()  # model_name labels of the engine's own series
    # Cumulative counters for the latency model (extproc/scheduling/latency.py); -1: not exported.
    ttft_sum_s: float = 0.0  # vllm:time_to_first_token_seconds_sum
    ttft_count: float = -1.0  # vllm:time_to_first_token_seconds_count
    prompt_tokens: float = -1.0  # vllm:prompt_tokens_total
    # vllm:num_requests_waiting_by_reason{reason="capacity"}: requests waiting for KV blocks or a
    # sequence slot (-1: not exported, so why requests wait is unknown)
    waiting_capacity: float = -1.0
    # process_start_time_seconds (unix seconds; -1: not exported): a new value is a restarted engine,
    # whose cache is empty whatever the indexes hold (Datastore.on_restarted).
    started_at: float = -1.0
    updated_at: float = 0.0  # time.monotonic() when the last successful scrape was sent (no later than its render)
    # The scrape interval in force when it was taken (extproc/scraping/plan.py: it grows with the
    # pool beyond the scrape budget); staleness is judged against it too (extproc/scheduling/load.py).
    interval_s: float = 0.0
    ok: bool = False  # False after a failed scrape


@dataclass(slots=True, eq=False)
class Endpoint:
    spec: EndpointSpec
    key: str
    inflight: int = 0
    # In-flight count when the last scrape landed: requests routed since then are not yet in the
    # scraped queue, so load = scraped waiting + (inflight - inflight_at_scrape).
    inflight_at_scrape: int = 0
    metrics: ModelServerMetrics | None = None
    added_at: float = field(default_factory=time.monotonic)
    # Its datastore's change log (every endpoint of one datastore shares it): `release` is told
    # the endpoint alone.
    changes: Changes = field(default_factory=Changes)

    @property
    def address(self) -> str:
        return self.spec.address

    @property
    def port(self) -> int:
        return self.spec.port


Listener = Callable[[Endpoint], None]


class Datastore:
    def __init__(self) -> None:
        self._endpoints: dict[str, Endpoint] = {}
        self._snapshot: tuple[Endpoint, ...] = ()
        self._on_added: list[Listener] = []
        self._on_removed: list[Listener] = []
        self._on_restarted: list[Listener] = []
        self._on_acquired: list[Listener] = []
        self.synced = False  # discovery has listed everything at least once
        self.generation = 0
        self.changes = Changes()

    # -- listeners -----------------------------------------------------------------------
    def on_added(self, fn: Listener) -> None:
        self._on_added.append(fn)

    def on_removed(self, fn: Listener) -> None:
        self._on_removed.append(fn)

    def on_restarted(self, fn: Listener) -> None:
        """`fn(endpoint)` when a scrape shows the engine's process started anew (its cache is empty)."""
        self._on_restarted.append(fn)

    def on_changed(self, fn: Callable[[], None]) -> None:
        """`fn()` whenever an endpoint's in-flight count or scrape changes, or one is added (`changes`)."""
        self.changes.listen(fn)

    def on_acquired(self, fn: Listener) -> None:
        """`fn(endpoint)` when a request is routed there (the scraper refreshes it sooner); keep it O(1)."""
        self._on_acquired.append(fn)

    # -- writes (discovery) ----------------------------------------------------------------
    def set_endpoints(self, specs: Iterable[EndpointSpec]) -> None:
        wanted = {s.key: s for s in specs}
        for key in [k for k in self._endpoints if k not in wanted]:
            self._remove(key)
        for spec in wanted.values():
            self._upsert(spec)
        self._rebuild()

    def upsert(self, spec: EndpointSpec) -> None:
        self._upsert(spec)
        self._rebuild()

    def remove(self, key: str) -> None:
        if self._remove(key):
            self._rebuild()

    def _upsert(self, spec: EndpointSpec) -> None:
        ep = self._endpoints.get(spec.key)
        if ep is None:
            ep = Endpoint(spec=spec, key=spec.key, changes=self.changes)
            self._endpoints[spec.key] = ep
            self.changes.add(spec.key)
            for fn in self._on_added:
                fn(ep)
        elif ep.spec != spec:
            ep.spec = spec

    def _remove(self, key: str) -> bool:
        ep = self._endpoints.pop(key, None)
        if ep is None:
            return False
        for fn in self._on_removed:
            fn(ep)
        return True

    def _rebuild(self) -> None:
        self._snapshot = tuple(self._endpoints.values())
        self.generation += 1

    # -- writes (metrics scraping) ---------------------------------------------------------
    def set_metrics(self, key: str, metrics: ModelServerMetrics) -> None:
        ep = self._endpoints.get(key)
        if ep is None:
            return
        before = ep.metrics.started_at if ep.metrics is not None else -1.0
        ep.metrics = metrics
        self.changes.add(key)
        if metrics.ok:
            ep.inflight_at_scrape = ep.inflight
            if before > 0 and metrics.started_at > 0 and metrics.started_at != before:
                for fn in self._on_restarted:
                    fn(ep)

    # -- reads (request path) --------------------------------------------------------------
    def snapshot(self) -> tuple[Endpoint, ...]:
        return self._snapshot

    def get(self, key: str) -> Endpoint | None:
        return self._endpoints.get(key)

    def __len__(self) -> int:
        return len(self._endpoints)

    # -- in-flight accounting --------------------------------------------------------------
    def acquire(self, key: str) -> Endpoint | None:
        ep = self._endpoints.get(key)
        if ep is not None:
            ep.inflight += 1
            self.changes.add(key)
            for fn in self._on_acquired:
                fn(ep)
        return ep

    @staticmethod
    def release(ep: Endpoint) -> None:
        """Release one in-flight request on an endpoint (also if it has since left the pool)."""
        if ep.inflight > 0:
            ep.inflight -= 1
            ep.changes.add(ep.key)
        if ep.inflight_at_scrape > ep.inflight:
            ep.inflight_at_scrape = ep.inflight
