"""One outgoing connection to a peer: identify it, stream frames to it, fetch its snapshot.

- `offer(frame, records)`: never blocks; the frame joins a queue of at most `peer_queue_frames`
  frames, else it is dropped and its records counted (`dropped["peer_queue_full"]`). A slow or
  unreachable peer therefore costs bounded memory and never slows the request path.
- `run()`: connect, `Hello` (learn the peer's origin id: a replica that reaches itself, e.g.
  listed in its own --peers or behind a shared port, stops the link), then one long `Push`
  stream fed from the queue. On any error: reconnect after capped exponential backoff
  (`backoff_initial_s` .. `backoff_max_s`).
- Only a HELLO_REPLY that names this HELLO's seq identifies the peer. A HELLO sent back to us
  (reflected: it carries our own origin), an old reply, or any other frame is refused
  (`rejected["bad_reply"]`) and the link retries as after any error; only a true answer from
  this very process closes it.
- `snapshot(apply, timeout)`: `Snapshot` stream; every chunk is checked (extproc/sync/admission.py,
  off the event loop) and must answer this request, then it is applied.
- `credentials`: TLS to the peer (`--sync-tls`), else plaintext.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from extproc.config.settings import SyncConfig
from extproc.sync.admission import Admission
from extproc.sync.outbox import SyncStats
from extproc.sync.wire import BAD_REPLY, HELLO, HELLO_REPLY, SNAPSHOT, SNAPSHOT_REQUEST, Frame, FrameError

log = logging.getLogger("prefix_epp.sync")

SERVICE = "prefixepp.sync.v1.IndexSync"
HELLO_METHOD = f"/{SERVICE}/Hello"
PUSH_METHOD = f"/{SERVICE}/Push"
SNAPSHOT_METHOD = f"/{SERVICE}/Snapshot"


@dataclass(frozen=True)
class PeerCredentials:
    """TLS for links to peers: what to trust and the name their certificate must carry."""

    channel: grpc.ChannelCredentials
    server_name: str


def channel_options(cfg: SyncConfig) -> list[tuple[str, Any]]:
    limit = cfg.max_frame_bytes
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
            ("grpc.keepalive_time_ms", 20000), ("grpc.keepalive_permit_without_calls", 1)]


class PeerLink:
    def __init__(self, address: str, admission: Admission, origin: int, cfg: SyncConfig, stats: SyncStats,
                 credentials: PeerCredentials | None = None) -> None:
        self.address = address
        self._admission = admission
        self._codec = admission.codec
        self._credentials = credentials
        self._origin = origin
        self._cfg = cfg
        self._stats = stats
        self._queue: asyncio.Queue[tuple[bytes, int]] = asyncio.Queue(cfg.peer_queue_frames)
        self._channel: grpc.aio.Channel | None = None
        self.peer_origin: int | None = None
        self.connected = False

    @property
    def is_self(self) -> bool:
        return self.peer_origin == self._origin

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    def offer(self, frame: bytes, records: int) -> None:
        if self.is_self:
            return
        try:
            self._queue.put_nowait((frame, records))
        except asyncio.QueueFull:
            self._stats.dropped["peer_queue_full"] += records

    def _chan(self) -> grpc.aio.Channel:
        if self._channel is None:
            options = channel_options(self._cfg)
            creds = self._credentials
            if creds is None:
                self._channel = grpc.aio.insecure_channel(self.address, options=options)
            else:
                options.append(("grpc.ssl_target_name_override", creds.server_name))
                self._channel = grpc.aio.secure_channel(self.address, creds.channel, options=options)
        return self._channel

    async def identify(self, timeout: float) -> int:
        """The peer's origin id (Hello), authenticated both ways."""
        call = self._chan().unary_unary(HELLO_METHOD)
        seq, hello = self._codec.encode_seq(HELLO, self._origin)
        reply = await call(hello, timeout=timeout)
        frame = await self._decode(reply, HELLO_REPLY, seq)
        self.peer_origin = frame.origin
        return frame.origin

    async def _decode(self, data: bytes, kind: int, reply_to: int) -> Frame:
        """A checked answer of `kind` to our request `reply_to`; FrameError otherwise (counted)."""
        frame = await self._admission.open(data, self.address)  # counts its own refusals
        if frame.kind != kind or frame.reply_to != reply_to:
            self._stats.rejected[BAD_REPLY] += 1
            raise FrameError(f"expected an answer of kind {kind} to frame {reply_to}, got kind {frame.kind} "
                             f"answering {frame.reply_to}", BAD_REPLY)
        return frame

    async def run(self) -> None:
        delay = self._cfg.backoff_initial_s
        warned = False
        try:
            while True:
                try:
                    await self.identify(timeout=max(1.0, self._cfg.backoff_max_s))
                    if self.is_self:
                        log.info("peer is this replica; link closed", extra={"peer": self.address})
                        return
                    self.connected = True
                    delay = self._cfg.backoff_initial_s
                    log.info("peer connected", extra={"peer": self.address})
                    push = self._chan().stream_unary(PUSH_METHOD)
                    await push(self._frames())
                except (grpc.aio.AioRpcError, FrameError) as exc:
                    self._stats.connect_failures += 1
                    refused = isinstance(exc, FrameError) or exc.code() == grpc.StatusCode.UNAUTHENTICATED
                    if refused and not warned:  # a configuration error: say it once, keep trying
                        warned = True
                        log.warning("peer refused us or we refused its answer: different sync secrets?",
                                    extra={"peer": self.address, "error": _describe(exc)})
                    elif self.connected:
                        log.warning("peer link lost", extra={"peer": self.address, "error": _describe(exc)})
                    else:
                        log.debug("peer unreachable", extra={"peer": self.address, "error": _describe(exc)})
                self.connected = False
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._cfg.backoff_max_s)
        finally:
            self.connected = False

    async def _frames(self) -> AsyncIterator[bytes]:
        stats = self._stats
        while True:
            frame, records = await self._queue.get()
            yield frame
            stats.frames_sent += 1
            stats.records_sent += records
            stats.bytes_sent += len(frame)

    async def snapshot(self, apply: Callable[[Frame], int], timeout: float) -> int:
        """Fetch and apply the peer's whole index; returns the entries loaded."""
        call = self._chan().unary_stream(SNAPSHOT_METHOD)
        seq, ask = self._codec.encode_seq(SNAPSHOT_REQUEST, self._origin)
        stream = call(ask, timeout=timeout)
        loaded = 0
        async for chunk in stream:
            frame = await self._decode(chunk, SNAPSHOT, seq)
            apply(frame)
            loaded += sum(len(hashes) for _, _, hashes in frame.records)
        return loaded

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close(grace=None)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)
