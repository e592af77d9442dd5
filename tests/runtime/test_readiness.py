"""The health services gate as the Inference Extension's protocol says, on a started picker (real
gRPC): `liveness` (and "") SERVING while the process runs; `readiness` and the ext_proc service
NOT_SERVING until discovery has synced and, with peer sync, the warm start is over; back to
NOT_SERVING on drain. (Discovery from a real kube-apiserver, and readiness before the pool is
listed, are tested end to end in tests/e2e/test_kubernetes_discovery.py.)"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc

from extproc.config.settings import EppConfig, SyncConfig
from extproc.discovery.static import load_static
from extproc.pb import health_pb2, health_pb2_grpc
from extproc.runtime.app import App
from extproc.transport.health import EXT_PROC_SERVICE
from testkit.procs import free_ports
from testkit.sync import until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
GATED = ("readiness", EXT_PROC_SERVICE)
ALWAYS = ("", "liveness")


@contextlib.asynccontextmanager
async def started(tmp: Path, **fields: object) -> AsyncIterator[tuple[App, health_pb2_grpc.HealthStub]]:
    grpc_port, health_port = free_ports(2)
    cfg = replace(EppConfig(), grpc_port=grpc_port, grpc_health_port=health_port, metrics_port=0,
                  secure_serving=False, refresh_metrics_interval_s=0, bind_address="127.0.0.1",
                  **fields)  # type: ignore[arg-type]
    app = App(cfg)
    await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            yield app, health_pb2_grpc.HealthStub(channel)
    finally:
        await app.stop(grace=0)


async def statuses(stub: health_pb2_grpc.HealthStub) -> dict[str, int]:
    out = {}
    for service in (*ALWAYS, *GATED):
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        out[service] = reply.status
    return out


async def test_not_ready_until_discovery_has_synced_then_not_ready_again_on_drain(tmp_path: Path) -> None:
    async with started(tmp_path) as (app, stub):  # no endpoints yet: discovery has listed nothing
        assert await statuses(stub) == {"": SERVING, "liveness": SERVING,
                                        "readiness": NOT_SERVING, EXT_PROC_SERVICE: NOT_SERVING}
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=EXT_PROC_SERVICE), timeout=30)
        assert (await watch.read()).status == NOT_SERVING
        load_static(app.datastore, ["127.0.0.1:9"])  # what discovery's first listing does
        assert (await watch.read()).status == SERVING  # Envoy's Watch sees the change
        assert set((await statuses(stub)).values()) == {SERVING}
        assert await app.drain() == 0  # no stream open: drained at once, nothing cut
        assert (await watch.read()).status == NOT_SERVING
        assert await statuses(stub) == {"": SERVING, "liveness": SERVING,
                                        "readiness": NOT_SERVING, EXT_PROC_SERVICE: NOT_SERVING}
        watch.cancel()


async def test_with_peer_sync_not_ready_until_the_warm_start_is_over(tmp_path: Path) -> None:
    """Discovery is synced at once (static endpoints), but a peer is configured: readiness waits
    for its snapshot. The peer is not up at first (its port refuses), so the picker stays
    NOT_SERVING (the warm timeout is far away); once the peer starts, the picker loads its
    snapshot and turns SERVING, well before the timeout."""
    sync_port, peer_port = free_ports(2)
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    sync = replace(SyncConfig(), port=sync_port, secret_file=str(secret), peers=(f"127.0.0.1:{peer_port}",),
                   warm_timeout_s=120.0, backoff_initial_s=0.05, backoff_max_s=0.2)
    async with started(tmp_path, endpoints=("127.0.0.1:9",), sync=sync) as (app, stub):
        assert app.datastore.synced and app.sync is not None and not app.sync.warm
        got = await statuses(stub)
        assert all(got[s] == SERVING for s in ALWAYS) and all(got[s] == NOT_SERVING for s in GATED), got
        peer_sync = replace(sync, port=peer_port, peers=(f"127.0.0.1:{sync_port}",), warm_timeout_s=0.1)
        async with started(tmp_path, endpoints=("127.0.0.1:9",), sync=peer_sync):
            await until(lambda: app.sync is not None and app.sync.warm, timeout=60)
            assert set((await statuses(stub)).values()) == {SERVING}
