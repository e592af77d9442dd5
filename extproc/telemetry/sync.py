"""Prometheus collector of peer sync (read at scrape time; the request path only bumps ints).

| metric | type | labels |
|---|---|---|
| prefix_epp_sync_frames_sent_total / _records_sent_total / _bytes_sent_total | counter | - |
| prefix_epp_sync_frames_received_total / _bytes_received_total | counter | - |
| prefix_epp_sync_records_applied_total | counter | - (peers' records applied to our index) |
| prefix_epp_sync_frames_forwarded_total | counter | - (handed on to sibling workers) |
| prefix_epp_sync_dropped_records_total | counter | reason (`DROP_REASONS`) |
| prefix_epp_sync_rejected_frames_total | counter | reason (`REJECT_REASONS`, extproc/sync/wire.py) |
| prefix_epp_sync_connect_failures_total | counter | - |
| prefix_epp_sync_snapshots_served_total, _snapshot_entries_loaded_total | counter | - |
| prefix_epp_sync_peers / prefix_epp_sync_peers_connected | gauge | - |
| prefix_epp_sync_outbox_records | gauge | - (records waiting for the next flush) |
| prefix_epp_sync_warm | gauge | - (1 once the warm start has finished) |
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from extproc.sync.manager import PeerSync
from extproc.sync.wire import REASONS

DROP_REASONS = ("outbox_full", "peer_queue_full", "frame_too_large", "unknown_endpoint")
REJECT_REASONS = REASONS


class SyncCollector(Collector):
    def __init__(self, sync: PeerSync) -> None:
        self._sync = sync

    def collect(self) -> Iterator[Metric]:
        s = self._sync.stats
        for name, value, doc in (
            ("frames_sent", s.frames_sent, "Frames sent to peers"),
            ("records_sent", s.records_sent, "Index records sent to peers"),
            ("bytes_sent", s.bytes_sent, "Frame bytes sent to peers"),
            ("frames_received", s.frames_received, "Frames received from peers"),
            ("bytes_received", s.bytes_received, "Frame bytes received from peers"),
            ("records_applied", s.records_applied, "Peer records applied to the index"),
            ("frames_forwarded", s.frames_forwarded, "Frames forwarded to sibling workers"),
            ("connect_failures", s.connect_failures, "Failed or lost peer connections"),
            ("snapshots_served", s.snapshots_served, "Index snapshots served to peers"),
            ("snapshot_entries_loaded", s.snapshot_entries_loaded, "Index entries loaded from peer snapshots"),
        ):
            yield CounterMetricFamily(f"prefix_epp_sync_{name}", doc, value=value)
        dropped = CounterMetricFamily("prefix_epp_sync_dropped_records", "Records dropped instead of waiting",
                                      labels=["reason"])
        for reason in DROP_REASONS:
            dropped.add_metric([reason], s.dropped.get(reason, 0))
        yield dropped
        rejected = CounterMetricFamily("prefix_epp_sync_rejected_frames", "Frames refused", labels=["reason"])
        for reason in REJECT_REASONS:
            rejected.add_metric([reason], s.rejected.get(reason, 0))
        yield rejected
        yield GaugeMetricFamily("prefix_epp_sync_peers", "Peers known", value=len(self._sync.links))
        yield GaugeMetricFamily("prefix_epp_sync_peers_connected", "Peers connected",
                                value=self._sync.connected_peers())
        yield GaugeMetricFamily("prefix_epp_sync_outbox_records", "Records waiting for the next flush",
                                value=len(self._sync.outbox))
        yield GaugeMetricFamily("prefix_epp_sync_warm", "1 once the warm start has finished",
                                value=1 if self._sync.warm else 0)
