"""Static discovery: a fixed `--endpoints host:port,host:port` list."""

from __future__ import annotations

from collections.abc import Iterable

from extproc.datastore import Datastore, EndpointSpec, split_host_port


def parse_endpoints(values: Iterable[str]) -> list[EndpointSpec]:
    """Parse `ip:port` items (comma-separated strings allowed); raises ValueError naming a bad item."""
    specs: list[EndpointSpec] = []
    seen: set[str] = set()
    for value in values:
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            host, port = split_host_port(item)
            spec = EndpointSpec(address=host, port=port, name=item)
            if spec.key not in seen:
                seen.add(spec.key)
                specs.append(spec)
    return specs


def load_static(datastore: Datastore, values: Iterable[str]) -> None:
    datastore.set_endpoints(parse_endpoints(values))
    datastore.synced = True
