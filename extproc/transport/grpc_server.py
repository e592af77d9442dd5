"""The gRPC servers: ext_proc on --grpc-port (TLS unless --secure-serving=false) and health on
--grpc-health-port (plaintext, for kubelet and Envoy health checks), each on its own address
(`bind`: --bind-address; `health_bind`: --health-bind-address, else --bind-address). A port
that cannot be bound is a StartupError naming its flag.

Every ext_proc stream is counted open/closed in a `StreamTracker` (extproc/transport/streams.py) so a drain
can wait for the last one. With `reuse_port` (--workers > 1) several processes bind the ext_proc
port and the kernel spreads connections over them; `health_port` 0 serves no separate health port
(a worker other than the first: the pod has one health endpoint).

The servicer reads and writes the stream through `Call` (extproc/transport/call.py), which ends
it without leaving grpc.aio's native memory behind whether the proxy resets finished streams or
closes them gracefully; `python -m bench.stream_ends` measures both ways
(bench/results/stream-ends.md). Each stream's end is counted by what became of the exchange and by
who closed the call (extproc/transport/stream_end.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from extproc.config.validate import StartupError, bind_message
from extproc.control.director import Director
from extproc.core.datastore import join_host_port
from extproc.pb import external_processor_pb2 as pb
from extproc.pb import external_processor_pb2_grpc as pb_grpc
from extproc.pb import health_pb2_grpc
from extproc.telemetry.epp import EppMetrics
from extproc.transport.body_budget import BodyBudget
from extproc.transport.call import Call, EndWait
from extproc.transport.health import HealthServicer
from extproc.transport.processor import StreamProcessor
from extproc.transport.streams import StreamTracker
from extproc.transport.tls import server_credentials

_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, director: Director, metrics: EppMetrics, explain: bool, streams: StreamTracker,
                 budget: BodyBudget | None) -> None:
        self._director = director
        self._metrics = metrics
        self._explain = explain
        self._streams = streams
        self._budget = budget
        self._end_wait = EndWait()

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        # A coroutine, not an async generator: grpc.aio then leaves the writes to the handler (call.py).
        processor = StreamProcessor(self._director, self._metrics, self._explain, self._budget)
        self._streams.opened()
        self._metrics.open_streams += 1
        closed_by = "proxy"  # until the proxy's half-close ends the requests: a reset (or a fault)
        call = Call(context, self._end_wait)
        try:
            async for resp in processor.run(call):
                await call.write(resp)
                del resp
            await call.finish()  # the proxy's end, after the response's end was accounted (call.py)
            closed_by = "picker"
        finally:
            self._streams.closed()
            self._metrics.open_streams -= 1
            self._metrics.stream_ended(processor.stream_end.end, closed_by)


async def start_servers(
    director: Director, metrics: EppMetrics, health: HealthServicer, *, bind: str, grpc_port: int,
    health_port: int, health_bind: str, secure: bool, cert_path: str, explain: bool, streams: StreamTracker,
    reuse_port: bool = False, budget: BodyBudget | None = None, client_ca_file: str = "",
) -> list[grpc.aio.Server]:
    options = [*_OPTIONS[1:], ("grpc.so_reuseport", 1 if reuse_port else 0)]
    # A BUFFERED request body arrives as one message: allow the largest body the picker accepts.
    options.append(("grpc.max_receive_message_length",
                    max(16 * 1024 * 1024, director.config.max_request_body_bytes + 1024 * 1024)))
    if reuse_port:
        # The kernel balances connections, not streams, and a proxy keeps few long connections:
        # a GOAWAY every minute makes it reconnect, landing on a random worker; streams already
        # open on the old connection finish there (no grace limit).
        options += [("grpc.max_connection_age_ms", 60_000), ("grpc.max_connection_age_grace_ms", 2**31 - 1)]
    ext = grpc.aio.server(options=options)
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(director, metrics, explain, streams, budget), ext)
    health_pb2_grpc.add_HealthServicer_to_server(health, ext)
    try:
        add_port(ext, "--grpc-port", "--bind-address", bind, grpc_port,
                server_credentials(cert_path, client_ca_file) if secure else None)
    except StartupError:
        await ext.stop(None)
        raise
    await ext.start()
    if not health_port:
        return [ext]
    hs = grpc.aio.server(options=_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(health, hs)
    try:
        add_port(hs, "--grpc-health-port", "--health-bind-address", health_bind, health_port, None)
    except StartupError:
        await asyncio.gather(ext.stop(None), hs.stop(None))
        raise
    await hs.start()
    return [ext, hs]


def add_port(server: grpc.aio.Server, flag: str, address_flag: str, host: str, port: int,
            credentials: grpc.ServerCredentials | None) -> None:
    """Add the port; gRPC's failure to bind (a RuntimeError, or 0 from older versions) becomes a
    StartupError naming the flag. `prefix-epp serve` checked the port already (extproc/commands/
    preflight.py): this is a port taken since."""
    address = join_host_port(host, port)
    try:
        bound = (server.add_insecure_port(address) if credentials is None
                 else server.add_secure_port(address, credentials))
    except RuntimeError:
        bound = 0
    if not bound:
        raise StartupError(bind_message(flag, address_flag, host, port))
