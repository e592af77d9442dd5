"""gRPC health service (grpc.health.v1) with the services Envoy and Kubernetes probe.

Services: "" and "liveness" are SERVING while the process runs; "readiness" and
"envoy.service.ext_proc.v3.ExternalProcessor" become SERVING once discovery has listed the
pool (`Datastore.synced`) and go NOT_SERVING again while shutting down.

`Watch` streams stay open and poll the status every 0.5 s, so their number is capped:
`max_watches` (EppConfig.max_health_watches, 64) at once across both ports; one more is refused
with RESOURCE_EXHAUSTED at once. Kubelet and Envoy's gRPC health checks use `Check`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc

from extproc.pb import health_pb2, health_pb2_grpc

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    def __init__(self, ready: Callable[[], bool], max_watches: int) -> None:
        self._ready = ready
        self.shutting_down = False
        self.max_watches = max_watches
        self.watches = 0  # Watch streams open now

    def status(self, service: str) -> health_pb2.HealthCheckResponse.ServingStatus | None:
        if service in ("", "liveness"):
            return _SERVING
        if service in ("readiness", EXT_PROC_SERVICE):
            return _SERVING if self._ready() and not self.shutting_down else _NOT_SERVING
        return None

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self.status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        if self.watches >= self.max_watches:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many health Watch streams (at most {self.max_watches}); use Check")
        self.watches += 1
        try:
            last = None
            while True:
                status = self.status(request.service)
                if status is None:
                    status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                if status != last:
                    yield health_pb2.HealthCheckResponse(status=status)
                    last = status
                await asyncio.sleep(0.5)
        finally:
            self.watches -= 1
