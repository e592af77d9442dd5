"""Admission of received frames: bounded work per sending host, none of it on the event loop.

Every frame a peer (or anyone who reaches the sync port) sends goes through `Admission.open`,
in this order; each step is cheap next to the one after it:
1. Length: more than `max_frame_bytes` (3 MiB; the gRPC server refuses larger messages before
   the handler runs, and this check holds for every path) -> refused, no work (`too_large`).
2. Failure budget of the sending host (its IP address, from the gRPC peer string): a token
   bucket of `failure_burst` (8) tokens refilled at `failure_rate_per_s` (1/s). Each frame that
   fails its check takes a token; with none left the host's frames are refused unchecked
   (`throttled`) until one refills. A peer holding the secret never fails, so it is never
   throttled unless it shares its address with a forger.
3. One frame per host at a time: a per-host lock, so a host's frames wait for each other rather
   than crowding out other hosts; open calls per host are capped by the service
   (`max_calls_per_host`).
4. The check itself (`Codec.decode`: MAC, inflate, parse) on a pool of `verify_threads` (1)
   thread(s). HMAC-SHA256 and zlib release the GIL on large buffers, so the event loop keeps
   routing while a frame is checked; a forger's share of the CPU is at most one thread, shared
   fairly with every other host.
5. Replay guard (extproc/sync/replay.py) on the loop: a frame whose (origin, seq) was seen
   before is refused (`replayed`); it takes a token too, as it cost a check.
Every refusal is counted in `SyncStats.rejected[reason]` (reasons: extproc/sync/wire.py).

Hosts are kept in a table of at most `max_hosts` (4,096) entries, least recently seen evicted.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from extproc.config.settings import SyncConfig
from extproc.sync.outbox import SyncStats
from extproc.sync.replay import ReplayGuard
from extproc.sync.wire import REPLAYED, THROTTLED, TOO_LARGE, Codec, Frame, FrameError


@dataclass
class _Host:
    tokens: float
    at: float
    calls: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def peer_host(peer: str) -> str:
    """The address part of a gRPC peer string: `ipv4:10.0.0.7:5123` -> `ipv4:10.0.0.7`."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


class Admission:
    def __init__(self, codec: Codec, cfg: SyncConfig, stats: SyncStats) -> None:
        self.codec = codec
        self._cfg = cfg
        self._stats = stats
        self.guard = ReplayGuard(window=cfg.replay_window, max_origins=cfg.max_origins,
                                 forget_after_s=2 * cfg.max_clock_skew_s)
        self._executor = ThreadPoolExecutor(cfg.verify_threads, thread_name_prefix="sync-verify")
        self._hosts: OrderedDict[str, _Host] = OrderedDict()
        self.checked = 0  # frames that reached step 4 (a forger's cost to us)

    def _host(self, host: str, now: float) -> _Host:
        h = self._hosts.get(host)
        if h is None:
            while len(self._hosts) >= self._cfg.max_hosts:
                self._hosts.popitem(last=False)
            h = self._hosts[host] = _Host(float(self._cfg.failure_burst), now)
        else:
            self._hosts.move_to_end(host)
        cfg = self._cfg
        h.tokens = min(float(cfg.failure_burst), h.tokens + (now - h.at) * cfg.failure_rate_per_s)
        h.at = now
        return h

    def enter_call(self, host: str) -> bool:
        """Count an open call of `host`; False (nothing counted) past `max_calls_per_host`, or while
        the host is throttled: then the call ends before its first message is read."""
        h = self._host(host, time.monotonic())
        if h.calls >= self._cfg.max_calls_per_host or h.tokens < 1:
            self._stats.rejected[THROTTLED] += 1
            return False
        h.calls += 1
        return True

    def leave_call(self, host: str) -> None:
        h = self._hosts.get(host)
        if h is not None and h.calls > 0:
            h.calls -= 1

    async def open(self, data: bytes, host: str) -> Frame:
        """The authenticated, fresh frame in `data`, or FrameError (counted by its reason)."""
        try:
            return await self._open(data, host)
        except FrameError as exc:
            self._stats.rejected[exc.reason] += 1
            raise

    async def _open(self, data: bytes, host: str) -> Frame:
        if len(data) > self.codec.max_frame_bytes:
            raise FrameError(f"frame of {len(data)} bytes, more than {self.codec.max_frame_bytes}", TOO_LARGE)
        h = self._host(host, time.monotonic())
        async with h.lock:
            if h.tokens < 1:  # read under the lock: frames that queued behind a failure see it
                raise FrameError("too many refused frames from this address; try later", THROTTLED)
            self.checked += 1
            try:
                frame = await asyncio.get_running_loop().run_in_executor(self._executor, self.codec.decode, data)
            except FrameError:
                h.tokens -= 1
                raise
        if not self.guard.accept(frame.origin, frame.seq, time.monotonic()):
            h.tokens -= 1  # a replay costs the check above, like a forgery
            raise FrameError(f"frame {frame.seq} of origin {frame.origin:x} seen before", REPLAYED)
        return frame

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
