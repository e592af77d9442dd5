"""What an engine may send to one subscription: every bound in one place (KVEventsConfig).

An engine is not trusted to behave: a bug or a hostile pod must not exhaust the picker's memory or
its event loop.
- Frames: every socket (SUB and replay DEALER) refuses frames over `max_message_bytes`
  (ZMQ_MAXMSGSIZE, 4 MiB: libzmq disconnects the peer; the SUB socket reconnects and the lost
  messages show as a sequence gap). 4 MiB holds one engine step's EventBatch of ~450k tokens
  (<= 5 bytes per token id, <= 2 x 34 bytes per block for stored and removed hashes): 50x vLLM's
  default max_num_batched_tokens (8192, ~50 KB).
- Queues: at most `receive_hwm` (64) messages wait in a socket (ZMQ_RCVHWM); beyond that libzmq
  stops reading and the publisher keeps them (vLLM's PUB high-water mark: 100,000).
- Replays: at most `max_replay_messages` (20,000; vLLM keeps `buffer_steps` = 10,000) and
  `max_replay_bytes` (64 MiB) are taken from one replay; a larger one is abandoned (outcome
  `oversized`) and the source resyncs.
- Rate: a `ByteBudget` per source, a token bucket of `max_bytes_per_second` (4 MiB/s; an engine
  prefilling 200k tokens/s publishes ~1.9 MB/s) holding two seconds' worth, and at least one
  frame. A live message it cannot pay for is dropped (`dropped["rate-limited"]`) and the source
  resyncs, logged once per episode: the engine is scored approximately until it publishes within
  the budget for `resync_window_s`. Replays after a gap or a late join are charged to the same
  budget, even below zero (the debt is paid by dropping live messages), so provoking replays buys
  no extra work; only the replay right after connecting is free (once per subscription).
- Reconnection: libzmq drops a connection whose peer sent a frame over ZMQ_MAXMSGSIZE and, unlike
  after a network error, never connects it again; `keep_connected` watches the socket's events and
  connects again when no reconnection followed a disconnect within a back-off (1 s, doubling up
  to 30 s while the publisher keeps misbehaving).
Not bounded here: libzmq holds a multipart message until its last frame arrives, and
ZMQ_MAXMSGSIZE limits each frame, not the number of frames (no libzmq option does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from extproc.config.settings import KVEventsConfig

log = logging.getLogger("prefix_epp.kvevents")

RECONNECT_INITIAL_S = 1.0
RECONNECT_MAX_S = 30.0


class ByteBudget:
    """Token bucket: `rate` bytes per second, holding at most `burst` bytes (it starts full)."""

    __slots__ = ("at", "burst", "rate", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.tokens, self.at = rate, burst, burst, now

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now

    def take(self, n: int, now: float) -> bool:
        """Pay `n` bytes if the budget holds them; False (nothing paid) if not."""
        self._refill(now)
        if n > self.tokens:
            return False
        self.tokens -= n
        return True

    def charge(self, n: int, now: float) -> None:
        """Pay `n` bytes even below zero (work already done: later messages pay the debt)."""
        self._refill(now)
        self.tokens -= n


def budget_for(config: KVEventsConfig, now: float) -> ByteBudget:
    rate = config.max_bytes_per_second
    return ByteBudget(rate, max(2 * rate, config.max_message_bytes), now)


def bounded_socket(ctx: zmq.asyncio.Context, kind: int, config: KVEventsConfig) -> zmq.asyncio.Socket:
    """A socket that refuses frames over max_message_bytes and queues at most receive_hwm messages
    (both must be set before connecting)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
    sock.setsockopt(zmq.RCVHWM, config.receive_hwm)
    return sock


async def keep_connected(sock: zmq.asyncio.Socket, address: str, endpoint: str) -> None:
    """Connect `sock` to `address` again whenever libzmq gave a dropped connection up (see above)."""
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    backoff, last = RECONNECT_INITIAL_S, 0.0
    try:
        while True:
            if parse_monitor_message(await monitor.recv_multipart())["event"] != zmq.EVENT_DISCONNECTED:
                continue
            if time.monotonic() - last > RECONNECT_MAX_S:
                backoff = RECONNECT_INITIAL_S  # the last reconnection held: a fresh episode
            try:
                while parse_monitor_message(await asyncio.wait_for(monitor.recv_multipart(), backoff))[
                        "event"] != zmq.EVENT_CONNECTED:
                    pass
            except TimeoutError:
                log.warning("kv events publisher disconnected and not reconnected (a frame over "
                            "--kv-events-max-message-bytes?); connecting again",
                            extra={"endpoint": endpoint, "events": address, "backoff_s": backoff})
                with contextlib.suppress(zmq.ZMQError):
                    sock.disconnect(address)
                sock.connect(address)
                backoff, last = min(2 * backoff, RECONNECT_MAX_S), time.monotonic()
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(linger=0)
