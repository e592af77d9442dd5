"""Static discovery: a fixed `--endpoints IP:port,IP:port` list.

An item may name its engine's KV-events publisher (and replay socket) after `@`, e.g.
`127.0.0.1:8001@tcp://127.0.0.1:5601` or `...@tcp://127.0.0.1:5601@tcp://127.0.0.1:5701`; the
text after the first `@` becomes `EndpointSpec.kv_events_endpoint` (see extproc/kvevents/manager.py).
Items are read by the one parser of the flag (extproc/config/values.py `endpoint`): an IP
address, never a host name, since the gateway routes each request to the picked address.
`--endpoint-roles IP:port=ROLE,...` gives endpoints the prefill/decode role a pod's `llm-d.ai/role`
label gives it under Kubernetes discovery: the same label, in `EndpointSpec.labels`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from extproc.config.values import endpoint, endpoint_role
from extproc.core.datastore import ROLE_LABEL, Datastore, EndpointSpec


def parse_roles(values: Iterable[str]) -> dict[str, str]:
    """`IP:port=ROLE` items -> {endpoint key: role}; raises ValueError naming a bad item."""
    return dict(endpoint_role(item) for item in values)


def parse_endpoints(values: Iterable[str], roles: Iterable[str] = ()) -> list[EndpointSpec]:
    """Parse `IP:port` items (comma-separated strings allowed), labelled with their `roles` items;
    raises ValueError naming a bad item, or a role given to an endpoint not listed."""
    role_of = parse_roles(roles)
    specs: list[EndpointSpec] = []
    seen: set[str] = set()
    for value in values:
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            host, port, events = endpoint(item)
            spec = EndpointSpec(address=host, port=port, name=item.partition("@")[0], kv_events_endpoint=events)
            if spec.key in role_of:
                spec = replace(spec, labels=((ROLE_LABEL, role_of[spec.key]),))
            if spec.key not in seen:
                seen.add(spec.key)
                specs.append(spec)
    if unknown := sorted(set(role_of) - seen):
        raise ValueError(f"--endpoint-roles names {', '.join(unknown)}, not among --endpoints")
    return specs


def load_static(datastore: Datastore, values: Iterable[str], roles: Iterable[str] = ()) -> None:
    datastore.set_endpoints(parse_endpoints(values, roles))
    datastore.synced = True
