"""Data-parallel ranks: where each rank of an endpoint publishes, and which endpoint a batch is for.

Addresses (`source_addresses`):
- events: `EndpointSpec.kv_events_endpoint` when set (Kubernetes: annotation
  `prefix-epp.io/kv-events-endpoint`, the pod's rank-0 publisher; static: `host:port@tcp://h:p`),
  else `tcp://<endpoint host>:<--kv-events-port>` (5557, vLLM's default);
- replay: a second `@tcp://h:p` in that field, else `tcp://<events host>:<--kv-events-replay-port>`
  when that flag is > 0 (0, the default: no replay);
- data-parallel ranks: vLLM's rank g publishes on the events port + g and replays on the replay
  port + g (`ZmqEventPublisher.offset_endpoint_port`). An endpoint of rank r (its port's position
  in the InferencePool's targetPorts, `EndpointSpec.rank`; 0 for static endpoints) with
  `--kv-events-dp-size` d (ranks behind its one HTTP port, vLLM's internal balancer; default 1)
  holds ranks g = r*d .. r*d + d - 1, one subscription each. llm-d's router dials the same ports
  (the base port + the rank's position in targetPorts). Entries are kept per (endpoint, rank); an
  endpoint's match is its best rank. With one rank per endpoint, r = g.
- no port serves two ranks: where a rank's publisher port would be another rank's replay port
  (`--kv-events-port 5557 --kv-events-replay-port 5558` with two ranks: vLLM's rank 1 could not
  even bind), the endpoint is refused (logged, scored approximately): a replay base at least the
  ranks' count above the events base (5600 beside 5557) never collides.

Rank attribution (`Attribution`, one per subscription): each batch's `data_parallel_rank` names the rank
whose cache changed. The subscription's own rank, no rank, or rank 0 (what every engine without
data parallelism says: vLLM's dense-model external balancing is independent engines, each
publishing rank 0 on its own port) go to the subscription's (endpoint, rank). Another rank goes to
the endpoint of that rank on the same pod (address, `RankOwners`), in a slot of the publisher's
own; a rank the pod has no endpoint for is dropped (`prefix_epp_kv_events_other_rank_batches_total`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from extproc.config.settings import KVEventsConfig
from extproc.core.datastore import Endpoint
from extproc.kvevents.index import Source

log = logging.getLogger("prefix_epp.kvevents")
Owner = Callable[[int], str | None]  # data-parallel rank -> the endpoint holding it on this pod


@dataclass(frozen=True, slots=True)
class SourceAddress:
    """One publisher: the endpoint it is subscribed for, its rank and its sockets."""

    endpoint: str  # datastore key
    rank: int
    events: str  # tcp://host:port of the PUB socket
    replay: str | None = None  # tcp://host:port of the ROUTER replay socket

    @property
    def source(self) -> Source:
        return (self.endpoint, self.rank)


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _split_tcp(address: str) -> tuple[str, int] | None:
    """(host, port) of tcp://host:port or tcp://[v6]:port; None for anything else."""
    if not address.startswith("tcp://"):
        return None
    rest = address[6:]
    host, sep, port = rest[1:].partition("]:") if rest.startswith("[") else rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host, int(port)


def _offset(address: str, rank: int) -> str:
    if rank == 0:
        return address
    parsed = _split_tcp(address)
    if parsed is None:
        raise ValueError(f"cannot offset {address!r} by a data-parallel rank")
    return _tcp(parsed[0], parsed[1] + rank)


def _check_disjoint(events: str, replay: str, ranks: int) -> None:
    """Raise ValueError when ranks 0..ranks-1 of one pod would put a publisher on a replay port."""
    ev, rp = _split_tcp(events), _split_tcp(replay)
    if ev is None or rp is None or ev[0] != rp[0] or abs(ev[1] - rp[1]) >= ranks:
        return
    port = max(ev[1], rp[1])
    raise ValueError(f"port {port} would be both a rank's KV-event publisher and another rank's replay "
                     f"socket (events base {ev[1]}, replay base {rp[1]}, {ranks} ranks): put the replay "
                     f"base at least {ranks} ports from the events base")


def source_addresses(ep: Endpoint, config: KVEventsConfig) -> list[SourceAddress]:
    """Where each rank of `ep` publishes (and replays); see the module docstring. Raises ValueError
    for an address that cannot be offset by a rank, or a publisher on a replay port."""
    per_endpoint = max(1, config.dp_size)
    first = ep.spec.rank * per_endpoint
    explicit = ep.spec.kv_events_endpoint.strip()
    events, _, replay = explicit.partition("@") if explicit else (_tcp(ep.address, config.port), "", "")
    if not replay and config.replay_port > 0:
        parsed = _split_tcp(events)
        host = parsed[0] if parsed is not None else ep.address
        replay = _tcp(host, config.replay_port)
    if replay:
        _check_disjoint(events, replay, first + per_endpoint)
    ranks = range(first, first + per_endpoint)
    return [SourceAddress(ep.key, g, _offset(events, g), _offset(replay, g) if replay else None) for g in ranks]


class RankOwners:
    """(pod address, rank) -> the endpoint subscribed for it: what `Attribution` asks."""

    def __init__(self) -> None:
        self._owners: dict[tuple[str, int], str] = {}
        self._owned: dict[str, list[tuple[str, int]]] = {}  # endpoint key -> its (address, rank)s

    def add(self, key: str, address: str, ranks: list[int]) -> None:
        self._owned[key] = [(address, r) for r in ranks]
        for owned in self._owned[key]:
            self._owners.setdefault(owned, key)

    def remove(self, key: str) -> None:
        for owned in self._owned.pop(key, ()):
            if self._owners.get(owned) == key:
                del self._owners[owned]

    def clear(self) -> None:
        self._owners.clear()
        self._owned.clear()

    def owner(self, address: str, rank: int) -> str | None:
        return self._owners.get((address, rank))


class Attribution:
    """Where one subscription applies a batch of a given `data_parallel_rank` (module docstring).

    A batch of another rank goes to that rank's endpoint in a slot of its own, source (endpoint,
    -1 - this subscription's rank): `elsewhere` lists them, which the subscriber clears with its
    own entries, and clearing them never touches what that rank's own publisher said."""

    def __init__(self, address: SourceAddress, owner: Owner | None, counts: dict[str, int]) -> None:
        self.address = address
        self.elsewhere: set[Source] = set()
        self._owner = owner
        self._counts = counts  # SubscriberStats.other_rank: attributed, dropped
        self._dropped: set[int] = set()  # ranks whose batches were dropped (logged once each)

    def source_of(self, rank: int | None) -> Source | None:
        """The source a batch of `rank` is applied to; None: dropped."""
        own = self.address
        if rank is None or rank == own.rank or rank == 0 or self._owner is None:
            return own.source
        endpoint = self._owner(rank)
        if endpoint is None:
            self._counts["dropped"] += 1
            if rank not in self._dropped:
                self._dropped.add(rank)
                log.warning("kv events batch names a rank this pod has no endpoint for; dropped (are the "
                            "pool's targetPorts in rank order?)", extra={"endpoint": own.endpoint,
                                                                        "rank": own.rank, "batch_rank": rank})
            return None
        self._counts["attributed"] += 1
        source = (endpoint, -1 - own.rank)
        if source not in self.elsewhere:
            self.elsewhere.add(source)
            log.info("kv events batch of another rank, applied to that rank's endpoint",
                     extra={"endpoint": own.endpoint, "rank": own.rank, "batch_rank": rank, "applied_to": endpoint})
        return source
