"""Static discovery: a fixed `--endpoints IP:port,IP:port` list.

An item may name its engine's KV-events publisher (and replay socket) after `@`, e.g.
`127.0.0.1:8001@tcp://127.0.0.1:5601` or `...@tcp://127.0.0.1:5601@tcp://127.0.0.1:5701`; the
text after the first `@` becomes `EndpointSpec.kv_events_endpoint` (see extproc/kvevents/manager.py).
Items are read by the one parser of the flag (extproc/config/values.py `endpoint`): an IP
address, never a host name, since the gateway routes each request to the picked address.
"""

from __future__ import annotations

from collections.abc import Iterable

from extproc.config.values import endpoint
from extproc.core.datastore import Datastore, EndpointSpec


def parse_endpoints(values: Iterable[str]) -> list[EndpointSpec]:
    """Parse `IP:port` items (comma-separated strings allowed); raises ValueError naming a bad item."""
    specs: list[EndpointSpec] = []
    seen: set[str] = set()
    for value in values:
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            host, port, events = endpoint(item)
            spec = EndpointSpec(address=host, port=port, name=item.partition("@")[0], kv_events_endpoint=events)
            if spec.key not in seen:
                seen.add(spec.key)
                specs.append(spec)
    return specs


def load_static(datastore: Datastore, values: Iterable[str]) -> None:
    datastore.set_endpoints(parse_endpoints(values))
    datastore.synced = True
