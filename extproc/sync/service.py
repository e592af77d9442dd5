"""The gRPC service peers call (`prefixepp.sync.v1.IndexSync`, raw frames, no protobuf).

- `Hello(frame) -> frame`: both sides prove they hold the secret; the reply carries our origin id.
- `Push(stream frame) -> empty`: a peer's UPDATES frames, applied in arrival order. Frames made by
  this very process are skipped. With `forward` set (the pod-facing port of a multi-worker pod),
  each applied frame is also handed on unchanged to the sibling workers.
- `Snapshot(frame) -> stream frame`: our whole approximate index, `snapshot_chunk_hashes` hashes
  per frame, endpoints oldest entries first (LOAD records), so the receiver rebuilds the same
  recency order.
A frame that fails authentication ends the call with UNAUTHENTICATED and is counted in
`rejected`; nothing of it reaches the index.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from extproc.config.settings import SyncConfig
from extproc.prefix.index import PrefixIndex
from extproc.sync.link import SERVICE
from extproc.sync.outbox import SyncStats
from extproc.sync.wire import HELLO, LOAD, SNAPSHOT, SNAPSHOT_REQUEST, UPDATES, Codec, Frame, FrameError, Record


class SyncService:
    def __init__(self, codec: Codec, origin: int, cfg: SyncConfig, index: PrefixIndex, stats: SyncStats,
                 apply: Callable[[Frame], int], forward: Callable[[bytes, int], None] | None = None) -> None:
        self._codec = codec
        self._origin = origin
        self._cfg = cfg
        self._index = index
        self._stats = stats
        self._apply = apply
        self._forward = forward

    async def _check(self, data: bytes, kind: int, context: grpc.aio.ServicerContext) -> Frame:
        try:
            frame = self._codec.decode(data)
        except FrameError as exc:
            self._stats.rejected["unauthenticated" if "authentication" in str(exc) else "malformed"] += 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"frame refused: {exc}")
            raise  # abort raises; this line only satisfies the type checker
        if frame.kind != kind:
            self._stats.rejected["malformed"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"expected frame kind {kind}")
        return frame

    async def hello(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await self._check(request, HELLO, context)
        return self._codec.encode(HELLO, self._origin)

    async def push(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        stats = self._stats
        async for data in requests:
            frame = await self._check(data, UPDATES, context)
            stats.frames_received += 1
            stats.bytes_received += len(data)
            if frame.origin == self._origin:
                continue
            stats.records_applied += self._apply(frame)
            if self._forward is not None:
                self._forward(data, len(frame.records))
                stats.frames_forwarded += 1
        return b""

    async def snapshot(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        await self._check(request, SNAPSHOT_REQUEST, context)
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
                    yield self._codec.encode(SNAPSHOT, self._origin, records)
                    records, size = [], 0
        if records:
            yield self._codec.encode(SNAPSHOT, self._origin, records)


def add_to_server(server: grpc.aio.Server, service: SyncService) -> None:
    handlers: dict[str, Any] = {
        "Hello": grpc.unary_unary_rpc_method_handler(service.hello),
        "Push": grpc.stream_unary_rpc_method_handler(service.push),
        "Snapshot": grpc.unary_stream_rpc_method_handler(service.snapshot),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
