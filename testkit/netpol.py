"""Which connections a set of NetworkPolicies admits, by the rules of the Kubernetes API
(networking.k8s.io/v1), for tests that check who may reach a pod's ports.

`admits(policies, target, source, port)`: a `Pod` (namespace, labels, named container ports)
reached from another `Pod` on `port` (a number or a container port's name). Ingress only:
- a pod no Ingress policy selects admits everything;
- else a connection is admitted when one rule of one selecting policy matches: its `ports` (none:
  every port; a named port resolves through the target's container ports) and its `from` (none:
  every source; a peer with only `podSelector` selects pods of the policy's namespace, with only
  `namespaceSelector` every pod of the selected namespaces, with both the selected pods of the
  selected namespaces; `ipBlock` peers match no pod here);
- label selectors: `matchLabels` and `matchExpressions` (In, NotIn, Exists, DoesNotExist); an
  empty selector selects everything. Namespaces carry `kubernetes.io/metadata.name`.
Traffic from the pod's own node (kubelet probes) is always admitted by Kubernetes and is not
modelled.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: Mapping[str, str]
    ports: Mapping[str, int] = field(default_factory=dict)  # container port name -> number
    namespace_labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def ns_labels(self) -> dict[str, str]:
        return {**self.namespace_labels, "kubernetes.io/metadata.name": self.namespace}


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: Obj, policy_ns: str, source: Pod) -> bool:
    if "ipBlock" in peer:
        return False
    pods, namespaces = peer.get("podSelector"), peer.get("namespaceSelector")
    if namespaces is None:
        return source.namespace == policy_ns and selects(pods, source.labels)
    in_namespace = selects(namespaces, source.ns_labels)
    return in_namespace and (pods is None or selects(pods, source.labels))


def _port_matches(rule_ports: list[Obj] | None, target: Pod, port: int | str) -> bool:
    if not rule_ports:
        return True
    number = target.ports.get(port, -1) if isinstance(port, str) else port
    for p in rule_ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in p:
            return True
        wanted = p["port"]
        wanted_number = target.ports.get(wanted, -2) if isinstance(wanted, str) else wanted
        if wanted_number == number or (isinstance(wanted, int) and wanted <= number <= p.get("endPort", wanted)):
            return True
    return False


def admits(policies: Iterable[Obj], target: Pod, source: Pod, port: int | str) -> bool:
    selecting = [p for p in policies if p.get("kind") == "NetworkPolicy"
                 and p["metadata"].get("namespace") == target.namespace
                 and selects(p["spec"].get("podSelector", {}), target.labels)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    for policy in selecting:
        ns = policy["metadata"]["namespace"]
        for rule in policy["spec"].get("ingress") or []:
            sources = rule.get("from")
            if _port_matches(rule.get("ports"), target, port) and (
                    not sources or any(_peer_matches(peer, ns, source) for peer in sources)):
                return True
    return False
