"""One subscription to one engine publisher (endpoint, data-parallel rank): receive, check, apply.

Loop (one asyncio task, never on the request path): a zmq.asyncio SUB socket connects to the
publisher and subscribes to every topic. Each iteration takes the next message plus whatever is
already queued, up to `max_messages_per_iteration` (64), decodes and applies them to the index,
then yields to the event loop, so a burst never starves request handling.

Sequence numbers (8-byte big-endian, 0, 1, 2, ... per publisher), with `next` the expected one:
- seq == next: apply.
- seq > next (a gap: the PUB socket dropped messages at its high-water mark): with a replay
  endpoint, ask it for everything from `next` (DEALER; send ["", start as 8-byte big-endian];
  read [topic, seq, payload] after the empty delimiter until seq = -1, each read bounded by
  `replay_timeout_s`, 1 s; vLLM sends the topic frame, a reply without it is read as well). A
  replay that starts at `next` and is contiguous recovers exactly; queued live messages it already
  covered are skipped as duplicates. Otherwise (no replay, timeout, buffer no longer reaching
  back) *resync*: drop this source's entries and mark it uncertain, then apply what arrived.
- seq < next: a new publisher (engine restart: its cache is empty): drop the entries and start
  over at this sequence (0 is complete; anything else is also a gap from 0).
- the first message heard from a publisher that has run before (seq > 0, nothing of it held): a
  *late join*, the normal case when a picker starts beside running engines. With a replay
  endpoint the subscriber asks for everything from 0; otherwise, or where the engine's buffer
  (vLLM `buffer_steps`, 10,000) no longer reaches back to 0, it starts from what it has: nothing
  it holds can be stale, only what the engine stored before is missing, so the source is usable
  at once (counted in `late_joins`, logged with the first sequence number it saw).
With a replay endpoint the subscriber also replays from 0 right after connecting, so joining a
running engine recovers its whole state when the engine's buffer still holds it. An undecodable
payload counts as a loss (resync).

Bounds on what an engine sends: extproc/kvevents/limits.py (frame size, queue, replay size, a byte
budget per source; a message the budget cannot pay for is dropped and the source resyncs, as for a
loss). One loop iteration takes at most `max_messages_per_iteration` messages and `ITERATION_BYTES`
(1 MiB) before yielding.

Rank attribution: each batch's `data_parallel_rank` picks the index source it is applied to
(extproc/kvevents/ranks.py `Attribution`); what this subscription applied to another rank's
endpoint is cleared with its own entries.

`SourceState` is what the manager reads: a source is *usable* once it has heard from its
publisher (a message or a replay) and is not uncertain; an uncertain source becomes usable again
once fresh events have been applied for `resync_window_s` (default 5 s). Test seam: `loss(endpoint,
seq)` returning True discards a received message, exactly as a high-water-mark drop would.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import zmq
import zmq.asyncio

from extproc.config.settings import KVEventsConfig
from extproc.kvevents.index import PreciseIndex
from extproc.kvevents.limits import bounded_socket, budget_for, keep_connected
from extproc.kvevents.ranks import Attribution, Owner, SourceAddress
from extproc.kvevents.wire import Cleared, Removed, Stored, WireError, decode_batch

log = logging.getLogger("prefix_epp.kvevents")

END_OF_REPLAY = -1
ITERATION_BYTES = 1 << 20  # payload bytes decoded between two yields (~10 ms of decoding)
Clock = Callable[[], float]
Loss = Callable[[str, int], bool]


# What `SourceState.usable` reads, apart from the time: a change to one of them bumps `revision`
# (heard_at only when it is first set: later it moves with every message and decides nothing).
_USABILITY = frozenset({"heard_at", "uncertain_since", "fresh_since", "replaying"})


@dataclass(slots=True)
class SourceState:
    next_seq: int | None = None
    heard_at: float | None = None  # last message or replay
    uncertain_since: float | None = None
    fresh_since: float | None = None  # first event applied after the source became uncertain
    reason: str = "never-heard"
    replaying: bool = False
    # Bumped when any source's usability may have changed other than by time passing, so the
    # manager can keep its answer for a whole pool between changes (manager.py: usable_among).
    revision: ClassVar[int] = 0

    def __setattr__(self, name: str, value: object) -> None:
        if name in _USABILITY and (name != "heard_at" or getattr(self, "heard_at", None) is None):
            SourceState.revision += 1
        object.__setattr__(self, name, value)

    def usable(self, now: float, window_s: float) -> bool:
        if self.heard_at is None or self.replaying:
            return False
        if self.uncertain_since is None:
            return True
        if self.fresh_since is not None and now - self.fresh_since >= window_s:
            self.uncertain_since = self.fresh_since = None
            self.reason = ""
            return True
        return False


@dataclass(slots=True)
class SubscriberStats:
    messages: int = 0
    events: dict[str, int] = field(default_factory=lambda: {"BlockStored": 0, "BlockRemoved": 0,
                                                            "AllBlocksCleared": 0, "unknown": 0})
    gaps: int = 0
    restarts: int = 0
    replays: dict[str, int] = field(default_factory=lambda: {"recovered": 0, "incomplete": 0, "failed": 0,
                                                             "oversized": 0})
    dropped: dict[str, int] = field(default_factory=lambda: {"rate-limited": 0})  # live messages
    resyncs: dict[str, int] = field(default_factory=dict)
    decode_errors: int = 0
    late_joins: int = 0
    # batches naming another rank than their subscription's (and not 0): applied to that rank's
    # endpoint on the same pod, or dropped where it has none
    other_rank: dict[str, int] = field(default_factory=lambda: {"attributed": 0, "dropped": 0})


class Subscriber:
    def __init__(self, address: SourceAddress, ctx: zmq.asyncio.Context, index: PreciseIndex,
                 config: KVEventsConfig, stats: SubscriberStats, clock: Clock,
                 on_heard: Callable[[str], None] | None = None, loss: Loss | None = None,
                 owner: Owner | None = None) -> None:
        self.address = address
        self.state = SourceState()
        self._ctx = ctx
        self._index = index
        self._config = config
        self._stats = stats
        self._clock = clock
        self._on_heard = on_heard
        self._loss = loss
        self._ranks = Attribution(address, owner, stats.other_rank)
        self._dup_from: int | None = None  # live messages in [dup_from, next) were replayed already
        self._budget = budget_for(config, clock())
        self._replay_failure = "failed"  # outcome of the latest replay that returned None

    async def run(self) -> None:
        sock = bounded_socket(self._ctx, zmq.SUB, self._config)
        try:
            sock.connect(self.address.events)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            log.warning("kv events address unusable; endpoint scored approximately",
                        extra={"endpoint": self.address.endpoint, "events": self.address.events, "error": str(exc)})
            return
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        limit = max(1, self._config.max_messages_per_iteration)
        watcher = asyncio.get_running_loop().create_task(
            keep_connected(sock, self.address.events, self.address.endpoint), name="kv-events reconnect")
        try:
            if self.address.replay:
                await self._sync_from_start()
            while True:
                batch = [await sock.recv_multipart()]
                taken = sum(map(len, batch[0]))
                while len(batch) < limit and taken < ITERATION_BYTES:
                    try:
                        batch.append(await sock.recv_multipart(flags=zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    taken += sum(map(len, batch[-1]))
                for frames in batch:
                    await self.on_frames(frames)
                await asyncio.sleep(0)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            sock.close(linger=0)

    # -- message handling --------------------------------------------------------------------
    async def on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._stats.decode_errors += 1
            self._resync("malformed-message")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if self._loss is not None and self._loss(self.address.endpoint, seq):
            return
        if not self._budget.take(sum(map(len, frames)), self._clock()):
            self._drop(seq, "rate-limited")
            return
        await self.on_message(seq, frames[2])

    def _drop(self, seq: int, reason: str) -> None:
        """Skip message `seq` knowingly: what it said is lost, so the source's entries go and it is
        uncertain (logged when an episode starts); the sequence continues after it (no replay)."""
        st = self.state
        self._stats.dropped[reason] += 1
        self._heard()
        if st.uncertain_since is not None and st.reason == reason:
            self._clear()  # entries applied since may miss its removals
            st.fresh_since = None
        else:
            self._resync(reason)
        st.next_seq = seq + 1
        self._dup_from = None

    async def on_message(self, seq: int, payload: bytes) -> None:
        st = self.state
        self._heard()
        if self._dup_from is not None:
            if st.next_seq is not None and self._dup_from <= seq < st.next_seq:
                return
            self._dup_from = None
        expected = 0 if st.next_seq is None else st.next_seq
        if seq == expected:
            self._apply(seq, payload)
            return
        if seq < expected:
            self._stats.restarts += 1
            log.warning("kv events sequence went back: new publisher, entries dropped",
                        extra={"endpoint": self.address.endpoint, "rank": self.address.rank,
                               "expected_seq": expected, "seq": seq})
            self._clear()
            if seq == 0:
                self._apply(seq, payload)
                return
            expected = 0
        if st.next_seq is None:
            await self._join_late(seq, payload)
            return
        self._stats.gaps += 1
        log.info("kv events gap", extra={"endpoint": self.address.endpoint, "rank": self.address.rank,
                                         "expected_seq": expected, "seq": seq})
        if self.address.replay and await self._recover(expected, seq):
            if st.next_seq is None or seq >= st.next_seq:
                self._apply(seq, payload)
            return
        self._resync("gap")
        self._apply(seq, payload)

    async def _join_late(self, seq: int, payload: bytes) -> None:
        """The first message of a publisher that ran before: replay from 0, else start here."""
        items = await self._replay_from(0) if self.address.replay else None
        if items:
            await self._adopt_history(items)
        else:
            if self.address.replay:
                self._count_unusable(items)
            self._started_late(seq)
        if self.state.next_seq is None or seq >= self.state.next_seq:
            self._apply(seq, payload)

    def publisher_restarted(self) -> None:
        """Told from outside (a scrape saw the engine restart) before the new publisher spoke: drop
        this source's entries and take the next message as the start of a new sequence."""
        self._clear()
        self.state.next_seq = None
        self._dup_from = None
        self._stats.restarts += 1
        log.warning("kv events: engine restarted, entries dropped",
                    extra={"endpoint": self.address.endpoint, "rank": self.address.rank})

    def _started_late(self, first_seq: int) -> None:
        """Start from `first_seq`: drop whatever an earlier subscription of this source left behind."""
        self._clear()
        self._stats.late_joins += 1
        st = self.state
        st.uncertain_since = st.fresh_since = None
        st.reason = ""
        log.info("kv events joined a running publisher: what it stored before is not indexed",
                 extra={"endpoint": self.address.endpoint, "rank": self.address.rank, "first_seq": first_seq})

    def _heard(self) -> None:
        self.state.heard_at = self._clock()
        if self._on_heard is not None:
            self._on_heard(self.address.endpoint)

    def _apply(self, seq: int, payload: bytes) -> None:
        st = self.state
        st.next_seq = seq + 1
        self._stats.messages += 1
        try:
            batch = decode_batch(payload)
        except WireError as exc:
            self._stats.decode_errors += 1
            log.warning("kv events payload undecodable", extra={"endpoint": self.address.endpoint,
                                                                "seq": seq, "error": str(exc)[:200]})
            self._resync("undecodable")
            return
        source = self._ranks.source_of(batch.rank)
        if source is None:
            return
        index, counts = self._index, self._stats.events
        for ev in batch.events:
            index.apply(source, ev)
            name = ("BlockStored" if isinstance(ev, Stored) else "BlockRemoved" if isinstance(ev, Removed)
                    else "AllBlocksCleared" if isinstance(ev, Cleared) else "unknown")
            counts[name] += 1
        counts["unknown"] += batch.unknown
        if st.uncertain_since is not None and st.fresh_since is None:
            st.fresh_since = self._clock()

    def _clear(self) -> None:
        """Drop this source's entries and whatever it applied to other ranks' endpoints."""
        self._index.clear_source(self.address.source)
        for source in self._ranks.elsewhere:
            self._index.clear_source(source)

    def _resync(self, reason: str) -> None:
        st = self.state
        self._clear()
        st.uncertain_since = self._clock()
        st.fresh_since = None
        st.reason = reason
        self._stats.resyncs[reason] = self._stats.resyncs.get(reason, 0) + 1
        log.warning("kv events resync: entries dropped, endpoint uncertain (approximate fallback)",
                    extra={"endpoint": self.address.endpoint, "rank": self.address.rank, "reason": reason})

    # -- replay ------------------------------------------------------------------------------
    async def _sync_from_start(self) -> None:
        """Replay from 0 right after connecting: a complete replay makes the source certain."""
        items = await self._replay_from(0, charged=False)
        if items is None:
            self._stats.replays[self._replay_failure] += 1
            return
        self._heard()
        if items:
            await self._adopt_history(items)
        else:
            self.state.next_seq = 0
            self.state.reason = ""
            self._dup_from = None

    async def _adopt_history(self, items: list[tuple[int, bytes]]) -> None:
        """Apply a replay from 0: complete when it starts at 0, else a late start (the buffer no
        longer reaches back); queued live messages it covered are skipped as duplicates."""
        if items[0][0] == 0:
            self._stats.replays["recovered"] += 1
        else:
            self._stats.replays["incomplete"] += 1
            self._started_late(items[0][0])
        await self._apply_replayed(items)
        self._dup_from = items[0][0]

    async def _recover(self, start: int, held: int) -> bool:
        """Replay from `start`; False when nothing usable came back (the caller resyncs)."""
        items = await self._replay_from(start)
        if not items:
            self._count_unusable(items)
            log.warning("kv events replay failed", extra={"endpoint": self.address.endpoint, "start_seq": start,
                                                          "outcome": self._replay_failure if items is None
                                                          else "incomplete"})
            return False
        if items[0][0] == start:
            self._stats.replays["recovered"] += 1
        else:
            self._stats.replays["incomplete"] += 1
            self._resync("replay-incomplete")
        await self._apply_replayed(items)
        self._dup_from = held + 1
        return True

    async def _apply_replayed(self, items: list[tuple[int, bytes]]) -> None:
        limit = max(1, self._config.max_messages_per_iteration)
        taken = 0
        for n, (seq, payload) in enumerate(items):
            if self.state.next_seq is not None and seq != self.state.next_seq and n:
                self._resync("replay-not-contiguous")
            self._apply(seq, payload)
            taken += len(payload)
            if n % limit == limit - 1 or taken >= ITERATION_BYTES:
                taken = 0
                await asyncio.sleep(0)

    def _count_unusable(self, items: list[tuple[int, bytes]] | None) -> None:
        self._stats.replays[self._replay_failure if items is None else "incomplete"] += 1

    async def _replay_from(self, start: int, charged: bool = True) -> list[tuple[int, bytes]] | None:
        """`fetch_replay`, with the source marked as replaying (not usable) meanwhile; what it read is
        charged to the byte budget unless `charged` is False (the replay right after connecting)."""
        self.state.replaying = True
        try:
            items = await self.fetch_replay(start)
        finally:
            self.state.replaying = False
        if charged and items:
            self._budget.charge(sum(len(p) + 16 for _, p in items), self._clock())
        return items

    async def fetch_replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """[(seq, payload)] for seq >= start from the replay socket; None on timeout or error, or
        beyond max_replay_messages / max_replay_bytes (`_replay_failure` says which)."""
        assert self.address.replay
        sock = bounded_socket(self._ctx, zmq.DEALER, self._config)
        timeout = self._config.replay_timeout_s
        max_messages, max_bytes = self._config.max_replay_messages, self._config.max_replay_bytes
        items: list[tuple[int, bytes]] = []
        received = size = 0
        self._replay_failure = "failed"
        try:
            sock.connect(self.address.replay)
            await sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), timeout)
                received += 1
                size += sum(map(len, frames))
                if received > max_messages + 1 or size > max_bytes:  # + 1: the end-of-replay marker
                    self._replay_failure = "oversized"
                    log.warning("kv events replay larger than allowed; abandoned", extra={
                        "endpoint": self.address.endpoint, "rank": self.address.rank, "messages": received,
                        "bytes": size, "max_messages": max_messages, "max_bytes": max_bytes})
                    return None
                if frames and not frames[0]:
                    frames = frames[1:]  # the empty delimiter
                if len(frames) == 3:
                    frames = frames[1:]  # the topic (vLLM sends it, as on the PUB socket)
                if len(frames) != 2 or len(frames[0]) != 8:
                    return None
                seq = int.from_bytes(frames[0], "big", signed=True)
                if seq == END_OF_REPLAY:
                    return items
                if seq >= start:
                    items.append((seq, frames[1]))
        except (TimeoutError, zmq.ZMQError):
            return None
        finally:
            sock.close(linger=0)
