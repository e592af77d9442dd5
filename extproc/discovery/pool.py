"""InferencePool and Pod objects -> endpoints: the pure part of Kubernetes discovery.

Nothing here talks to the API; extproc/discovery/kubernetes.py feeds these functions the raw
JSON dicts its watches deliver.

Pool shapes, chosen by the pool's API group (`--pool-group`):
- `inference.networking.k8s.io` (v1): `spec.selector.matchLabels`, `spec.targetPorts[].number`.
- `inference.networking.x-k8s.io` (legacy v1alpha2): `spec.selector` as a plain map,
  `spec.targetPortNumber`.
A selector must have at least one label (an empty one would select every pod of the namespace)
and the ports must be 1..65535, unique, at most 8; anything else is a `PoolError`.

A pod yields endpoints when all hold (the Go EPP's `IsPodReady` plus its label match):
its labels match the selector, condition `Ready` is `True`, it has no `deletionTimestamp` and it
has a `status.podIP`. Each target port at index i is one endpoint `<podIP>:<port>` named
`<pod>-rank-<i>`, of data-parallel rank i (`EndpointSpec.rank`: GIE's naming, and llm-d's router
dials that rank's KV-event port as the base port + i), so the ports are listed in rank order. The
annotation `llm-d.ai/active-ports` or, failing that, `inference.networking.k8s.io/active-ports`
("8000,8002") keeps only the listed ports (an endpoint keeps its index as its rank); when the
annotation is present but lists none of the target ports the pod has no endpoint (as in GIE).
A `status.podIP` that is not an IP address gives no endpoint.

KV events (`prefix-epp.io/kv-events-endpoint`, `kv_events_address`): the pod only chooses ports
on its own address, as a pod template cannot know its IP anyway. Each side of `events[@replay]`
is `PORT`, `tcp://*:PORT` (vLLM's own notation) or `tcp://<pod IP>:PORT`, and resolves to
`tcp://<pod IP>:PORT`, the pod's rank-0 publisher: the endpoint of rank i subscribes to PORT + i
(extproc/kvevents/manager.py), as vLLM offsets each rank's ports. An annotation naming any other
host (a name, another IP) is refused: the endpoint keeps the default address
(`tcp://<pod IP>:--kv-events-port` + rank), and discovery logs it and counts it
(`prefix_epp_discovery_refused_annotations_total`), so a pod cannot make the picker connect
elsewhere.

InferenceObjective (either API group, extproc/discovery/objectives.py): `spec.priority`
(absent -> 0) for objectives whose `spec.poolRef.name` is our pool.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from extproc.core.datastore import EndpointSpec

V1_GROUP = "inference.networking.k8s.io"
LEGACY_GROUP = "inference.networking.x-k8s.io"
POOL_VERSIONS = {V1_GROUP: "v1", LEGACY_GROUP: "v1alpha2"}
POOL_PLURAL = "inferencepools"
ACTIVE_PORTS_ANNOTATIONS = ("llm-d.ai/active-ports", "inference.networking.k8s.io/active-ports")
# Overrides where the picker subscribes to this pod's KV events (default: tcp://<pod IP>:--kv-events-port).
KV_EVENTS_ANNOTATION = "prefix-epp.io/kv-events-endpoint"
MAX_TARGET_PORTS = 8

Labels = tuple[tuple[str, str], ...]


class PoolError(ValueError):
    """The InferencePool object cannot be used (bad selector or ports)."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    namespace: str
    selector: Labels  # sorted (key, value) pairs
    target_ports: tuple[int, ...]

    def label_selector(self) -> str:
        """The selector as a Kubernetes `labelSelector` query string."""
        return ",".join(f"{k}={v}" for k, v in self.selector)


@dataclass(frozen=True, slots=True)
class PodInfo:
    name: str
    namespace: str
    labels: Labels
    ip: str
    ready: bool  # Ready=True and no deletionTimestamp
    active_ports: frozenset[int] | None  # None: no annotation, every target port is active
    kv_events_endpoint: str = ""  # from the prefix-epp.io/kv-events-endpoint annotation, resolved
    kv_events_refused: str = ""  # why that annotation was refused ("" when accepted or absent)
    kv_events_raw: str = ""  # the annotation as written


def pool_version(group: str) -> str:
    try:
        return POOL_VERSIONS[group]
    except KeyError:
        raise PoolError(f"unsupported --pool-group {group!r}; use one of {sorted(POOL_VERSIONS)}") from None


def _str_map(value: Any, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise PoolError(f"{what} must be a map of strings")
    return value


def parse_pool(obj: dict[str, Any], group: str) -> PoolSpec:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    if group == V1_GROUP:
        selector = _str_map((spec.get("selector") or {}).get("matchLabels") or {}, "spec.selector.matchLabels")
        raw_ports = [p.get("number") if isinstance(p, dict) else None for p in spec.get("targetPorts") or []]
    elif group == LEGACY_GROUP:
        selector = _str_map(spec.get("selector") or {}, "spec.selector")
        raw_ports = [spec.get("targetPortNumber")]
    else:
        pool_version(group)  # raises
        raise AssertionError("unreachable")
    if not selector:
        raise PoolError("the pool's selector is empty")
    ports: list[int] = []
    for p in raw_ports:
        if not isinstance(p, int) or isinstance(p, bool) or not 0 < p < 65536:
            raise PoolError(f"invalid target port {p!r}")
        if p in ports:
            raise PoolError(f"duplicate target port {p}")
        ports.append(p)
    if not ports or len(ports) > MAX_TARGET_PORTS:
        raise PoolError(f"a pool needs 1..{MAX_TARGET_PORTS} target ports, got {len(ports)}")
    return PoolSpec(
        name=str(meta.get("name", "")), namespace=str(meta.get("namespace", "")),
        selector=tuple(sorted(selector.items())), target_ports=tuple(ports),
    )


def _active_ports(annotations: dict[str, Any]) -> frozenset[int] | None:
    for key in ACTIVE_PORTS_ANNOTATIONS:
        value = annotations.get(key)
        if value is None:
            continue
        ports = set()
        for item in str(value).split(","):
            item = item.strip()
            if item.isdigit() and int(item) > 0:
                ports.add(int(item))
        return frozenset(ports)
    return None


def _own_port(side: str, pod_ip: str) -> int | None:
    """The port of `PORT`, `tcp://*:PORT` or `tcp://<pod IP>:PORT`; None for anything else."""
    host, port = "*", side
    if side.startswith("tcp://"):
        rest = side[6:]
        host, sep, port = rest[1:].partition("]:") if rest.startswith("[") else rest.rpartition(":")
        if not sep:
            return None
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        return None
    if host != "*":
        try:
            if ipaddress.ip_address(host) != ipaddress.ip_address(pod_ip):
                return None
        except ValueError:
            return None
    return int(port)


def kv_events_address(annotation: str, pod_ip: str) -> tuple[str, str]:
    """(resolved `tcp://<pod IP>:port[@tcp://<pod IP>:port]`, "") or ("", why it is refused)."""
    sides = annotation.split("@")
    ports = [_own_port(side.strip(), pod_ip) for side in sides]
    if len(sides) > 2 or any(p is None for p in ports):
        return "", "names another host than the pod's own IP, or is not PORT, tcp://*:PORT or tcp://<pod IP>:PORT"
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return "@".join(f"tcp://{host}:{p}" for p in ports), ""


def _pod_ip(value: Any) -> str:
    try:
        return str(ipaddress.ip_address(str(value or "")))
    except ValueError:
        return ""


def parse_pod(obj: dict[str, Any]) -> PodInfo:
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    ready = False
    for cond in status.get("conditions") or []:
        if isinstance(cond, dict) and cond.get("type") == "Ready":
            ready = cond.get("status") == "True"
            break
    if meta.get("deletionTimestamp"):
        ready = False
    labels = meta.get("labels") or {}
    ip = _pod_ip(status.get("podIP"))
    annotation = str((meta.get("annotations") or {}).get(KV_EVENTS_ANNOTATION, "")).strip()
    kv_events, refused = kv_events_address(annotation, ip) if annotation and ip else ("", "")
    return PodInfo(
        name=str(meta.get("name", "")),
        namespace=str(meta.get("namespace", "")),
        labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
        ip=ip,
        ready=ready,
        active_ports=_active_ports(meta.get("annotations") or {}),
        kv_events_endpoint=kv_events,
        kv_events_refused=refused,
        kv_events_raw=annotation,
    )


def selector_matches(labels: Labels, selector: Labels) -> bool:
    have = dict(labels)
    return all(have.get(k) == v for k, v in selector)


def pod_endpoints(pod: PodInfo, pool: PoolSpec) -> list[EndpointSpec]:
    """The endpoints a pod contributes to the pool (none unless it is selected, ready and addressed)."""
    if not pod.ready or not pod.ip or not selector_matches(pod.labels, pool.selector):
        return []
    out = []
    for rank, port in enumerate(pool.target_ports):
        if pod.active_ports is not None and port not in pod.active_ports:
            continue
        out.append(EndpointSpec(address=pod.ip, port=port, name=f"{pod.name}-rank-{rank}",
                                namespace=pod.namespace, labels=pod.labels,
                                kv_events_endpoint=pod.kv_events_endpoint, rank=rank))
    return out


def objective_priority(obj: dict[str, Any], pool_name: str) -> int | None:
    """The objective's priority if it refers to our pool (absent priority -> 0), else None."""
    spec = obj.get("spec") or {}
    ref = spec.get("poolRef") or {}
    if ref.get("name") != pool_name:
        return None
    priority = spec.get("priority")
    if isinstance(priority, int) and not isinstance(priority, bool):
        return priority
    return 0
