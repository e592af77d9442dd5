"""Static discovery: a fixed `--endpoints host:port,host:port` list.

An item may name its engine's KV-events publisher (and replay socket) after `@`, e.g.
`127.0.0.1:8001@tcp://127.0.0.1:5601` or `...@tcp://127.0.0.1:5601@tcp://127.0.0.1:5701`; the
text after the first `@` becomes `EndpointSpec.kv_events_endpoint` (see extproc/kvevents/manager.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from extproc.core.datastore import Datastore, EndpointSpec, split_host_port


def parse_endpoints(values: Iterable[str]) -> list[EndpointSpec]:
    """Parse `ip:port` items (comma-separated strings allowed); raises ValueError naming a bad item."""
    specs: list[EndpointSpec] = []
    seen: set[str] = set()
    for value in values:
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            item, _, events = item.partition("@")
            host, port = split_host_port(item)
            spec = EndpointSpec(address=host, port=port, name=item, kv_events_endpoint=events.strip())
            if spec.key not in seen:
                seen.add(spec.key)
                specs.append(spec)
    return specs


def load_static(datastore: Datastore, values: Iterable[str]) -> None:
    datastore.set_endpoints(parse_endpoints(values))
    datastore.synced = True
