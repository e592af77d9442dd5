"""KV-cache events over ZeroMQ, in vLLM's wire format (`--kv-events-config` with publisher zmq).

Transport
    A PUB socket bound to (or, with `connect=True`, connected to) `endpoint` sends one
    three-frame message per engine step that produced events::

        [topic (UTF-8), sequence (8-byte big-endian, 0, 1, 2, ... per publisher), msgpack EventBatch]

    The topic is the configured one, verbatim (vLLM's `--kv-events-config` "topic"; the replicas
    default to llm-d's documented form `kv@<host:port>@<model>`, which llm-d's router filters
    on with "kv@" and reads the model from). Sends never wait: the PUB socket drops at its
    high-water mark (`hwm`), as in vLLM. The last `buffer_steps` batches are kept for replay.

Replay (vLLM 0.32's ROUTER framing, checked against the real engine)
    With `replay_endpoint`, a ROUTER socket takes a request of exactly three frames
    `[identity, b"", start]` (a DEALER that sends an empty delimiter, or a REQ socket), start
    being an unsigned 8-byte big-endian sequence; anything else is logged and left unanswered,
    as vLLM does. The answer is one `[identity, b"", topic, seq, payload]` per buffered batch
    whose sequence is >= start, then the end marker `[identity, b"", b"", -1 (signed 8-byte), b""]`.

Payload (msgpack; vLLM's msgspec structs)
    EventBatch = [ts (unix seconds, float), [event, ...], data_parallel_rank (0)]
    encoding "map" (the default; what vLLM 0.32 sends: tagged structs as maps, defaults omitted):
        {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
         "lora_id", "medium": "GPU", "lora_name", "extra_keys": [None per block], "group_idx": 0,
         "kv_cache_spec_kind": "full_attention"}
        {"type": "BlockRemoved", "block_hashes", "medium": "GPU", "group_idx": 0}
        {"type": "AllBlocksCleared"}
    encoding "array" (older vLLM's array_like tagged tuples):
        ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, "GPU"(, lora_name)]
        ["BlockRemoved", block_hashes, "GPU"]
        ["AllBlocksCleared"]
    Block hashes are unsigned 64-bit integers (see `prefix_epp_sim.kvcache.hash_blocks`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from prefix_epp_sim.config import KVEventsEncoding
from prefix_epp_sim.kvcache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
MEDIUM = "GPU"
GROUP = 0  # the KV-cache group of a plain decoder's one full-attention group
SPEC_KIND = "full_attention"


def encode_event(event: KVEvent, encoding: KVEventsEncoding) -> Any:
    if isinstance(event, BlockStored):
        if encoding == "map":
            return {
                "type": "BlockStored", "block_hashes": event.block_hashes,
                "parent_block_hash": event.parent_block_hash, "token_ids": event.token_ids,
                "block_size": event.block_size, "lora_id": event.lora_id, "medium": MEDIUM,
                "lora_name": event.lora_name, "extra_keys": [None] * len(event.block_hashes),
                "group_idx": GROUP, "kv_cache_spec_kind": SPEC_KIND,
            }
        row: list[Any] = ["BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids,
                          event.block_size, event.lora_id, MEDIUM]
        if event.lora_name is not None:
            row.append(event.lora_name)
        return row
    if isinstance(event, BlockRemoved):
        if encoding == "map":
            return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": MEDIUM, "group_idx": GROUP}
        return ["BlockRemoved", event.block_hashes, MEDIUM]
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"} if encoding == "map" else ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(events: list[KVEvent], encoding: KVEventsEncoding, ts: float,
                 data_parallel_rank: int | None = 0) -> bytes:
    payload: bytes = msgpack.packb([ts, [encode_event(e, encoding) for e in events], data_parallel_rank])
    return payload


class KVEventPublisher:
    """Collects one step's events (`add`, the KV cache's sink) and publishes them (`flush`)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, topic: str, *,
                 encoding: KVEventsEncoding, buffer_steps: int, hwm: int, connect: bool,
                 replay_endpoint: str | None = None, data_parallel_rank: int | None = 0) -> None:
        """`encoding`, `buffer_steps`, `hwm` and `connect`: SimConfig's kv_events_* fields."""
        self.topic = topic
        self.encoding: KVEventsEncoding = encoding
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.dropped = 0
        self._ctx = ctx
        self._topic = topic.encode("utf-8")
        self._connect = connect
        self._hwm = hwm
        self._rank = data_parallel_rank
        self._pending: list[KVEvent] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._sub_task: asyncio.Task[None] | None = None
        self.subscriptions = 0  # subscribers connected now (XPUB subscription messages)

    @property
    def next_sequence(self) -> int:
        return self._seq

    def start(self) -> None:
        """Open the sockets; `endpoint`/`replay_endpoint` then hold the resolved addresses."""
        # XPUB sends exactly like PUB and also tells who subscribed, so callers can wait for a
        # subscriber instead of guessing how long ZeroMQ takes to connect (messages published
        # before a subscription arrives are dropped).
        pub = self._ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        try:
            if self._connect:
                pub.connect(self.endpoint)
            else:
                pub.bind(self.endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            pub.close()
            raise
        self._pub = pub
        self._sub_task = asyncio.create_task(self._count_subscriptions(pub), name="kv-events-subscriptions")
        if self.replay_endpoint:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            try:
                router.bind(self.replay_endpoint)
            except zmq.ZMQError:
                router.close()
                raise
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay = router
            self._replay_task = asyncio.create_task(self._serve_replay(router), name="kv-events-replay")

    def add(self, event: KVEvent) -> None:
        self._pending.append(event)

    def flush(self) -> None:
        """Publish the pending events as one batch (no-op when there are none)."""
        if not self._pending:
            return
        events, self._pending = self._pending, []
        payload = encode_batch(events, self.encoding, time.time(), self._rank)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if self._pub is None:
            return
        sent = self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.DONTWAIT)
        # With DONTWAIT the future is already resolved; read it so a drop is counted, not logged.
        if isinstance(sent, asyncio.Future) and sent.done() and sent.exception() is not None:
            self.dropped += 1

    async def _count_subscriptions(self, pub: zmq.asyncio.Socket) -> None:
        with contextlib.suppress(zmq.ZMQError):
            while True:
                frame = await pub.recv()
                if frame[:1] == b"\x01":
                    self.subscriptions += 1
                elif frame[:1] == b"\x00":
                    self.subscriptions = max(0, self.subscriptions - 1)

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await router.recv_multipart()
                # vLLM answers only [identity, empty delimiter, start]; a DEALER that sends no
                # delimiter gets nothing from the real engine, so it gets nothing here either.
                if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
                    log.warning("kv_events_replay_bad_request", extra={"frames": len(frames)})
                    continue
                head = frames[:2]
                start = int.from_bytes(frames[2], "big")
                # vLLM's reply framing: the topic frame as on the PUB socket, an empty one at the end.
                for seq, payload in [item for item in self._buffer if item[0] >= start]:
                    await router.send_multipart([*head, self._topic, seq.to_bytes(8, "big"), payload])
                await router.send_multipart([*head, b"", END_OF_REPLAY, b""])
            except zmq.ZMQError as exc:
                log.warning("kv_events_replay_failed", extra={"error": str(exc)})

    async def close(self) -> None:
        for task in (self._replay_task, self._sub_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
