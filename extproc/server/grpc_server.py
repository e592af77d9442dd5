"""The gRPC servers: ext_proc on --grpc-port (TLS unless --secure-serving=false) and health on
--grpc-health-port (plaintext, for kubelet and Envoy health checks)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from extproc.director import Director
from extproc.metrics.epp import EppMetrics
from extproc.pb import external_processor_pb2 as pb
from extproc.pb import external_processor_pb2_grpc as pb_grpc
from extproc.pb import health_pb2_grpc
from extproc.server.health import HealthServicer
from extproc.server.processor import StreamProcessor
from extproc.server.tls import server_credentials

_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, director: Director, metrics: EppMetrics, explain: bool) -> None:
        self._director = director
        self._metrics = metrics
        self._explain = explain

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        processor = StreamProcessor(self._director, self._metrics, self._explain)
        async for resp in processor.run(request_iterator):
            yield resp


async def start_servers(
    director: Director, metrics: EppMetrics, health: HealthServicer, *, bind: str, grpc_port: int,
    health_port: int, secure: bool, cert_path: str, explain: bool,
) -> tuple[grpc.aio.Server, grpc.aio.Server]:
    # A BUFFERED request body arrives as one message: allow the largest body the picker accepts.
    max_message = max(16 * 1024 * 1024, director.config.max_request_body_bytes + 1024 * 1024)
    ext = grpc.aio.server(options=[*_OPTIONS, ("grpc.max_receive_message_length", max_message)])
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(director, metrics, explain), ext)
    health_pb2_grpc.add_HealthServicer_to_server(health, ext)
    address = f"{bind}:{grpc_port}"
    if secure:
        ext.add_secure_port(address, server_credentials(cert_path))
    else:
        ext.add_insecure_port(address)
    hs = grpc.aio.server(options=_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(health, hs)
    hs.add_insecure_port(f"{bind}:{health_port}")
    await ext.start()
    await hs.start()
    return ext, hs
