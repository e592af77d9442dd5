"""The picker's real gRPC servers inside the test's own process and event loop.

For tests that need real gRPC (HTTP/2 framing, flow control, the servicer's reads) and want to
look inside the picker while a stream is open (its budget, its memory), which a separate
process would hide.

- `serving(app)`: `start_servers` for an `App` (testkit.extproc_stream.make_app) on two free ports,
  plaintext on 127.0.0.1; yields a `Served` with an ext_proc stub and a health stub on one channel
  each; stops the servers (no grace) on the way out.
- `open_stream(served)`: a Process call (an aio StreamStreamCall) with a 30 s deadline, so a test
  that waits for a reply never hangs.
- `wait_until(predicate)`: await, yielding to the loop, until `predicate()` holds (10 s at most).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from extproc.pb import external_processor_pb2_grpc as pb_grpc
from extproc.pb import health_pb2_grpc
from extproc.runtime.app import App
from extproc.transport.grpc_server import start_servers
from testkit.procs import free_ports


@dataclass
class Served:
    app: App
    ext_proc: pb_grpc.ExternalProcessorStub
    health: health_pb2_grpc.HealthStub


@contextlib.asynccontextmanager
async def serving(app: App) -> AsyncIterator[Served]:
    grpc_port, health_port = free_ports(2)
    servers = await start_servers(app.director, app.metrics, app.health, bind="127.0.0.1", grpc_port=grpc_port,
                                  health_port=health_port, health_bind="127.0.0.1", secure=False, cert_path="",
                                  explain=False, streams=app.streams, budget=app.body_budget)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as ext, \
                grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as hc:
            yield Served(app, pb_grpc.ExternalProcessorStub(ext), health_pb2_grpc.HealthStub(hc))
    finally:
        for server in servers:
            await server.stop(None)


def open_stream(served: Served) -> grpc.aio.StreamStreamCall:
    return served.ext_proc.Process(timeout=30)


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)
