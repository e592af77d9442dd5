"""Peer-sync replicas for tests: a `PeerSync` on loopback with fast timers and a known pool."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from extproc.config.settings import SyncConfig
from extproc.core.datastore import Datastore
from extproc.discovery.static import load_static
from extproc.prefix.index import PrefixIndex
from extproc.sync.manager import PeerSync

SECRET = b"k" * 32
FAST = replace(SyncConfig(), flush_interval_s=0.005, backoff_initial_s=0.05, backoff_max_s=0.2, warm_timeout_s=3.0)
POOL = [f"10.0.0.{i}:8000" for i in range(10)]  # the endpoints every replica's discovery knows


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.01)


def pool(endpoints: list[str] = POOL) -> Datastore:
    """A datastore that knows `endpoints`, as static discovery would (synced)."""
    store = Datastore()
    load_static(store, endpoints)
    return store


def replica(port: int, peers: list[int], secret: bytes = SECRET, bind: str = "127.0.0.1",
            **cfg: object) -> PeerSync:
    """A replica serving `port`, dialling the `peers` ports on 127.0.0.1, its index listener wired."""
    config = replace(FAST, port=port, peers=tuple(f"127.0.0.1:{p}" for p in peers), **cfg)  # type: ignore[arg-type]
    index = PrefixIndex(1000)
    sync = PeerSync(config, secret, index, None, datastore=pool(), bind=bind)
    index.on_record(sync.outbox.record)
    return sync
