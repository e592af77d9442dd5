"""The gRPC health service through the real gRPC server: Check answers, Watch streams are capped."""

from __future__ import annotations

import grpc
import pytest

from extproc.pb import health_pb2
from testkit.extproc_grpc import serving, wait_until
from testkit.extproc_stream import make_app

SERVING = health_pb2.HealthCheckResponse.SERVING


async def test_check_answers_readiness_and_liveness() -> None:
    app = make_app()
    async with serving(app) as served:
        for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = await served.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await served.health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_watch_streams_beyond_the_cap_get_resource_exhausted() -> None:
    """The attack: open Watch streams without end; each is held and polled for ever."""
    app = make_app(max_health_watches=2)
    async with serving(app) as served:
        watches = [served.health.Watch(health_pb2.HealthCheckRequest(service="readiness"), timeout=30)
                   for _ in range(2)]
        for w in watches:
            assert (await w.read()).status == SERVING
        extra = served.health.Watch(health_pb2.HealthCheckRequest(service="readiness"), timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await extra.read()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at most 2" in str(err.value.details())
        assert app.health.watches == 2
        # Check is not affected, and a Watch that ends frees its place.
        reply = await served.health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=10)
        assert reply.status == SERVING
        watches[0].cancel()
        await wait_until(lambda: app.health.watches == 1)
        again = served.health.Watch(health_pb2.HealthCheckRequest(service="readiness"), timeout=30)
        assert (await again.read()).status == SERVING
        again.cancel()
        watches[1].cancel()
        await wait_until(lambda: app.health.watches == 0)
