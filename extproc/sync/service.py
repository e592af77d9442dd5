"""The gRPC service peers call (`prefixepp.sync.v1.IndexSync`, raw frames, no protobuf).

- `Hello(HELLO) -> HELLO_REPLY`: both sides prove they hold the secret; the reply carries our
  origin id and names the HELLO's seq (extproc/sync/wire.py), so it answers that HELLO only.
- `Push(stream UPDATES) -> empty`: a peer's frames, applied in arrival order. Frames made by this
  very process are skipped. With `forward` set (the pod-facing port of a multi-worker pod), each
  applied frame is also handed on unchanged to the sibling workers.
- `Snapshot(SNAPSHOT_REQUEST) -> stream SNAPSHOT`: our whole approximate index,
  `snapshot_chunk_hashes` hashes per frame, endpoints oldest entries first (LOAD records), so the
  receiver rebuilds the same recency order.

Every frame goes through `Admission.open` first (extproc/sync/admission.py: size, the sender's
failure budget, the MAC and inflation on a thread, the replay guard); nothing of a frame reaches
the index before it passed. A refused frame ends the call (UNAUTHENTICATED, or
RESOURCE_EXHAUSTED when the sender is throttled) and is counted in `rejected[reason]`. A call
from a throttled address, or one past `max_calls_per_host` open calls of its address, ends before
its first message is read; the server caps open calls in all (`max_calls`, extproc/sync/manager.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from extproc.config.settings import SyncConfig
from extproc.prefix.index import PrefixIndex
from extproc.sync.admission import Admission, peer_host
from extproc.sync.link import SERVICE
from extproc.sync.outbox import SyncStats
from extproc.sync.wire import (
    BAD_REPLY,
    HELLO,
    HELLO_REPLY,
    LOAD,
    SNAPSHOT,
    SNAPSHOT_REQUEST,
    THROTTLED,
    UPDATES,
    Frame,
    FrameError,
    Record,
)


class SyncService:
    def __init__(self, admission: Admission, origin: int, cfg: SyncConfig, index: PrefixIndex, stats: SyncStats,
                 apply: Callable[[Frame], int], forward: Callable[[bytes, int], None] | None = None) -> None:
        self._admission = admission
        self._codec = admission.codec
        self._origin = origin
        self._cfg = cfg
        self._index = index
        self._stats = stats
        self._apply = apply
        self._forward = forward

    async def _check(self, data: bytes, kind: int, host: str, context: grpc.aio.ServicerContext) -> Frame:
        try:
            frame = await self._admission.open(data, host)
        except FrameError as exc:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.reason == THROTTLED else grpc.StatusCode.UNAUTHENTICATED
            await context.abort(code, f"frame refused: {exc}")
            raise  # abort raises; this line only satisfies the type checker
        if frame.kind != kind:
            self._stats.rejected[BAD_REPLY if frame.kind == HELLO_REPLY else "malformed"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"expected frame kind {kind}")
        return frame

    async def _enter(self, context: grpc.aio.ServicerContext) -> str:
        host = peer_host(context.peer() or "")
        if not self._admission.enter_call(host):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many open sync calls from this address")
        return host

    async def _one(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        async for data in requests:
            return data
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no frame")
        raise AssertionError  # abort raises

    async def hello(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        host = await self._enter(context)
        try:
            frame = await self._check(await self._one(requests, context), HELLO, host, context)
            return self._codec.encode(HELLO_REPLY, self._origin, reply_to=frame.seq)
        finally:
            self._admission.leave_call(host)

    async def push(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        host = await self._enter(context)
        stats = self._stats
        try:
            async for data in requests:
                frame = await self._check(data, UPDATES, host, context)
                stats.frames_received += 1
                stats.bytes_received += len(data)
                if frame.origin == self._origin:
                    continue
                stats.records_applied += self._apply(frame)
                if self._forward is not None:
                    self._forward(data, len(frame.records))
                    stats.frames_forwarded += 1
        finally:
            self._admission.leave_call(host)
        return b""

    async def snapshot(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        host = await self._enter(context)
        try:
            ask = await self._check(await self._one(requests, context), SNAPSHOT_REQUEST, host, context)
            self._stats.snapshots_served += 1
            chunk = self._cfg.snapshot_chunk_hashes
            records: list[Record] = []
            size = 0
            for endpoint, hashes in self._index.dump():
                for start in range(0, len(hashes), chunk):
                    part = hashes[start:start + chunk]
                    records.append((LOAD, endpoint, part))
                    size += len(part)
                    if size >= chunk:
                        yield self._codec.encode(SNAPSHOT, self._origin, records, reply_to=ask.seq)
                        records, size = [], 0
            if records:
                yield self._codec.encode(SNAPSHOT, self._origin, records, reply_to=ask.seq)
        finally:
            self._admission.leave_call(host)


def add_to_server(server: grpc.aio.Server, service: SyncService) -> None:
    handlers: dict[str, Any] = {
        # Peers call Hello and Snapshot as unary requests; served as request streams (the same
        # bytes on the wire) so a throttled sender is turned away before its message is read.
        "Hello": grpc.stream_unary_rpc_method_handler(service.hello),
        "Push": grpc.stream_unary_rpc_method_handler(service.push),
        "Snapshot": grpc.stream_stream_rpc_method_handler(service.snapshot),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
