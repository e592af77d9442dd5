"""gRPC health service (grpc.health.v1) with the services Envoy and Kubernetes probe.

Services: "" and "liveness" are SERVING while the process runs; "readiness" and
"envoy.service.ext_proc.v3.ExternalProcessor" become SERVING once discovery has listed the
pool (`Datastore.synced`) and go NOT_SERVING again while shutting down.
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
    def __init__(self, ready: Callable[[], bool]) -> None:
        self._ready = ready
        self.shutting_down = False

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
        last = None
        while True:
            status = self.status(request.service)
            if status is None:
                status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(0.5)
