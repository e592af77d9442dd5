"""`PeerSync`: N picker replicas route like one, by sharing what each records at decision time.

Algorithm (full mesh, no broker, no leader):
- The request path never sees this class: `App` registers `outbox.record` / `outbox.speculative`
  as listeners of the prefix index and the precise index, and `outbox.removed` on the datastore.
- Every `flush_interval_s` (20 ms) the outbox is cut into frames of at most `max_batch_records`
  records and about `max_batch_hashes` hashes; each frame is encoded once and offered to every
  peer link (bounded queues, drops counted). Frames carry their origin; applying a peer's
  records (`PrefixIndex.apply`, `KVEventsManager.apply_speculative`, `remove_endpoint`) notifies
  no listener, so nothing echoes.
- Peers: `set_peers(addresses)` diffs the set (static `--peers`, or the ready pods of our own
  Deployment from extproc/sync/kube_peers.py, live). A link that turns out to reach this very
  process (Hello returns our origin) closes itself, so a replica may list itself.
- Warm start: `warm_start()` asks peers (other pods; sibling workers only when there are none),
  in random order, for a snapshot until one answers or `warm_timeout_s` (5 s) has passed; `warm`
  then turns True (readiness waits for it), peer or not.
- Workers (extproc/runtime/workers.py): every worker of a pod binds the pod's sync port with SO_REUSEPORT
  and its own loopback `sibling_port`. Frames arriving on the pod port are applied and forwarded
  unchanged to the siblings; frames arriving on the sibling port are only applied; local frames go
  to peers and siblings. So each worker sees every decision once.
- Authentication: every frame is HMAC'd with the shared secret (extproc/sync/wire.py); the
  secret comes from `--sync-secret-file` or env PREFIX_EPP_SYNC_SECRET.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc

from extproc.config.settings import SyncConfig
from extproc.core.datastore import join_host_port
from extproc.prefix.index import PrefixIndex
from extproc.sync.link import PeerLink
from extproc.sync.outbox import Outbox, SyncStats
from extproc.sync.service import SyncService, add_to_server
from extproc.sync.wire import LOAD, RECORD, REMOVE, SPECULATIVE, UPDATES, Codec, Frame, FrameError

log = logging.getLogger("prefix_epp.sync")


class SpeculativeSink(Protocol):
    """Where peers' speculative precise entries go (KVEventsManager)."""

    def apply_speculative(self, endpoint: str, keys: Sequence[int]) -> None: ...

SECRET_ENV = "PREFIX_EPP_SYNC_SECRET"


def load_secret(cfg: SyncConfig) -> bytes:
    """The shared secret: --sync-secret-file, else env PREFIX_EPP_SYNC_SECRET; ValueError if none."""
    if cfg.secret_file:
        secret = Path(cfg.secret_file).read_bytes().strip()
    else:
        secret = os.environ.get(SECRET_ENV, "").strip().encode()
    if len(secret) < 16:
        raise ValueError(f"peer sync needs a shared secret of at least 16 bytes (--sync-secret-file or {SECRET_ENV})")
    return secret


class PeerSync:
    def __init__(self, cfg: SyncConfig, secret: bytes, index: PrefixIndex, precise: SpeculativeSink | None, *,
                 bind: str, reuse_port: bool = False, sibling_port: int = 0, siblings: Sequence[str] = ()) -> None:
        self.cfg = cfg
        self.index = index
        self.precise = precise
        self.origin = random.getrandbits(63) | 1
        self.stats = SyncStats()
        self.codec = Codec(secret, max_frame_bytes=cfg.max_frame_bytes, max_clock_skew_s=cfg.max_clock_skew_s)
        self.outbox = Outbox(cfg.pending_limit, self.stats)
        self.links: dict[str, PeerLink] = {}
        self.siblings = [PeerLink(a, self.codec, self.origin, cfg, self.stats) for a in siblings]
        self.warm = False
        self._bind = bind
        self._reuse_port = reuse_port
        self._sibling_port = sibling_port
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._servers: list[grpc.aio.Server] = []
        self._flusher: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()  # links of removed peers, closing

    # -- applying what peers send -------------------------------------------------------------
    def apply(self, frame: Frame) -> int:
        index, precise = self.index, self.precise
        for op, endpoint, hashes in frame.records:
            if op == RECORD:
                index.apply(endpoint, hashes)
            elif op == REMOVE:
                index.remove_endpoint(endpoint)
            elif op == SPECULATIVE and precise is not None:
                precise.apply_speculative(endpoint, hashes)
            elif op == LOAD:
                index.load(endpoint, hashes)
                self.stats.snapshot_entries_loaded += len(hashes)
        return len(frame.records)

    def _to_siblings(self, frame: bytes, records: int) -> None:
        for link in self.siblings:
            link.offer(frame, records)

    # -- peers ---------------------------------------------------------------------------------
    def set_peers(self, addresses: Iterable[str]) -> None:
        """Follow the peer set: links to new peers start, links to gone peers stop."""
        wanted = {a.strip() for a in addresses if a.strip()}
        for address in list(self.links):
            if address not in wanted:
                link = self.links.pop(address)
                task = self._tasks.pop(address, None)
                if task is not None:
                    task.cancel()
                self._closing.add(asyncio.get_running_loop().create_task(self._close(link, task)))
                log.info("peer removed", extra={"peer": address})
        for address in sorted(wanted - set(self.links)):
            link = PeerLink(address, self.codec, self.origin, self.cfg, self.stats)
            self.links[address] = link
            self._tasks[address] = asyncio.get_running_loop().create_task(link.run(), name=f"sync {address}")

    async def _close(self, link: PeerLink, task: asyncio.Task[None] | None) -> None:
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        with contextlib.suppress(Exception):
            await link.close()

    def connected_peers(self) -> int:
        return sum(1 for link in self.links.values() if link.connected)

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve the sync port (and the sibling port), start the flush loop and the sibling links."""
        limit = self.cfg.max_frame_bytes + 1024
        options: list[tuple[str, Any]] = [("grpc.so_reuseport", 1 if self._reuse_port else 0),
                                          ("grpc.max_receive_message_length", limit),
                                          ("grpc.max_send_message_length", limit)]
        forward = self._to_siblings if self.siblings else None
        ports = [(self._bind, self.cfg.port, forward)] if self.cfg.port else []
        if self._sibling_port:
            ports.append(("127.0.0.1", self._sibling_port, None))
        for host, port, fwd in ports:
            server = grpc.aio.server(options=options)
            add_to_server(server, SyncService(self.codec, self.origin, self.cfg, self.index, self.stats,
                                              self.apply, forward=fwd))
            server.add_insecure_port(join_host_port(host, port))
            await server.start()
            self._servers.append(server)
        loop = asyncio.get_running_loop()
        for link in self.siblings:
            self._tasks[f"sibling {link.address}"] = loop.create_task(link.run(), name=f"sync sibling {link.address}")
        self._flusher = loop.create_task(self._flush_loop(), name="sync-flush")
        if self.cfg.peers:
            self.set_peers(self.cfg.peers)
        log.info("peer sync started", extra={"port": self.cfg.port, "peers": len(self.links),
                                             "siblings": len(self.siblings)})

    async def warm_start(self) -> int:
        """Load one peer's snapshot, bounded by `warm_timeout_s`; returns the entries loaded."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.warm_timeout_s
        tried: set[str] = set()
        try:
            while (remaining := deadline - loop.time()) > 0:
                # Other pods first: sibling workers start together and are as cold as we are.
                pool = list(self.links.values()) or self.siblings
                untried = [link for link in pool if link.address not in tried]
                if not untried:
                    tried.clear()  # every peer failed once: maybe they were starting; try again
                    await asyncio.sleep(min(0.2, remaining))
                    continue
                link = random.choice(untried)
                tried.add(link.address)
                try:
                    if link.peer_origin is None:
                        await link.identify(timeout=min(1.0, remaining))
                    if link.is_self:
                        continue
                    started = loop.time()
                    loaded = await link.snapshot(self.apply, timeout=max(0.1, deadline - loop.time()))
                except (grpc.aio.AioRpcError, FrameError) as exc:
                    log.debug("no snapshot from peer", extra={"peer": link.address, "error": str(exc)})
                    continue
                log.info("warm start from peer snapshot", extra={
                    "peer": link.address, "entries": loaded, "seconds": round(loop.time() - started, 3)})
                return loaded
            log.info("warm start: no peer answered in time; starting cold",
                     extra={"timeout_s": self.cfg.warm_timeout_s})
            return 0
        finally:
            self.warm = True

    def flush(self) -> None:
        """Send what the outbox holds (one encoding per frame, offered to every link)."""
        links = [*self.links.values(), *self.siblings]
        while len(self.outbox):
            records = self.outbox.take(self.cfg.max_batch_records, self.cfg.max_batch_hashes)
            if not links:
                continue
            frame = self.codec.encode(UPDATES, self.origin, records)
            for link in links:
                link.offer(frame, len(records))

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.flush_interval_s)
            self.flush()

    async def stop(self, linger_s: float = 1.0) -> None:
        """Send what is left (waiting up to `linger_s` for connected links), then close."""
        self.flush()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + linger_s
        links = [*self.links.values(), *self.siblings]
        while any(link.connected and link.pending for link in links) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        tasks = [t for t in (self._flusher, *self._tasks.values(), *self._closing) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for link in [*self.links.values(), *self.siblings]:
            with contextlib.suppress(Exception):
                await link.close()
        await asyncio.gather(*(s.stop(0.5) for s in self._servers), return_exceptions=True)
        self._servers.clear()


