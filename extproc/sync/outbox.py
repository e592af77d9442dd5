"""The request path's side of peer sync: records wait here for the next flush.

Index listeners call `record`, `speculative` and `removed` synchronously at decision time; each
appends one tuple (the hash list is shared, not copied) unless `pending_limit` records already
wait, in which case the record is dropped and counted (`SyncStats.dropped["outbox_full"]`).
Nothing here awaits, locks or does I/O. The flush loop (extproc/sync/manager.py) calls `take`,
which cuts frames by records and by hashes, so a frame stays far below the gRPC message limit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from extproc.sync.wire import RECORD, REMOVE, SPECULATIVE, Record


@dataclass
class SyncStats:
    """Counters of one replica's sync traffic (exported by extproc/telemetry/sync.py)."""

    frames_sent: int = 0
    records_sent: int = 0
    bytes_sent: int = 0
    frames_received: int = 0
    records_applied: int = 0
    bytes_received: int = 0
    frames_forwarded: int = 0
    snapshots_served: int = 0
    snapshot_entries_loaded: int = 0
    dropped: Counter[str] = field(default_factory=Counter)  # reason -> records (fixed set of reasons)
    rejected: Counter[str] = field(default_factory=Counter)  # reason -> frames refused
    connect_failures: int = 0


class Outbox:
    def __init__(self, pending_limit: int, stats: SyncStats) -> None:
        self._pending: list[Record] = []
        self._limit = pending_limit
        self._stats = stats

    def _add(self, record: Record) -> None:
        if len(self._pending) >= self._limit:
            self._stats.dropped["outbox_full"] += 1
            return
        self._pending.append(record)

    def record(self, endpoint: str, hashes: Sequence[int]) -> None:
        self._add((RECORD, endpoint, hashes))

    def speculative(self, endpoint: str, keys: Sequence[int]) -> None:
        self._add((SPECULATIVE, endpoint, keys))

    def removed(self, endpoint: str) -> None:
        self._add((REMOVE, endpoint, ()))

    def take(self, limit: int, max_hashes: int) -> list[Record]:
        """The oldest records, at most `limit` of them and about `max_hashes` hashes (at least one record)."""
        pending = self._pending
        n, hashes = 0, 0
        for _, _, h in pending:
            if n >= limit or (n and hashes + len(h) > max_hashes):
                break
            n += 1
            hashes += len(h)
        batch, self._pending = pending[:n], pending[n:]
        return batch

    def __len__(self) -> int:
        return len(self._pending)
