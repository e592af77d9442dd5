"""Prometheus view of the KV-event subscriptions and the precise index (read at scrape time).

| metric | type | labels |
|---|---|---|
| prefix_epp_kv_events_index_entries | gauge | - (confirmed (source, block) entries) |
| prefix_epp_kv_events_index_bytes | gauge | - (entries x measured bytes per entry) |
| prefix_epp_kv_events_block_size | gauge | - (engine tokens per block of the request keys) |
| prefix_epp_kv_events_endpoint_usable | gauge | endpoint (0: scored by the approximate index) |
| prefix_epp_kv_events_tier_blocks | gauge | endpoint, tier (gpu, cpu, storage): confirmed blocks, all ranks |
| prefix_epp_kv_events_tier_hit_blocks_total | counter | tier (the chosen endpoints' matched blocks by tier) |
| prefix_epp_kv_events_messages_total | counter | - |
| prefix_epp_kv_events_events_total | counter | type (BlockStored, BlockRemoved, AllBlocksCleared, unknown) |
| prefix_epp_kv_events_blocks_total | counter | op (stored, removed, orphaned, evicted, skipped, resolved) |
| prefix_epp_kv_events_gaps_total, prefix_epp_kv_events_restarts_total | counter | - |
| prefix_epp_kv_events_replays_total | counter | outcome (recovered, incomplete, failed, oversized) |
| prefix_epp_kv_events_dropped_messages_total | counter | reason (rate-limited: over an engine's byte budget) |
| prefix_epp_kv_events_resyncs_total | counter | reason |
| prefix_epp_kv_events_late_joins_total | counter | - (publishers joined after their first message) |
| prefix_epp_kv_events_other_rank_batches_total | counter | outcome (attributed, dropped: extproc/kvevents/ranks.py) |
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.kvevents.manager import KVEventsManager
from extproc.kvevents.wire import TIERS


class KVEventsCollector(Collector):
    def __init__(self, manager: KVEventsManager) -> None:
        self._m = manager

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        m, idx, st = self._m, self._m.index, self._m.stats
        yield GaugeMetricFamily("prefix_epp_kv_events_index_entries", "Confirmed entries in the precise index",
                                value=idx.entries)
        yield GaugeMetricFamily("prefix_epp_kv_events_index_bytes", "Estimated memory of the precise index",
                                value=idx.approx_bytes())
        yield GaugeMetricFamily("prefix_epp_kv_events_block_size", "Engine tokens per block that requests are "
                                "keyed with (scraped, else from events, else --kv-events-block-size)",
                                value=m.block_size)
        usable = GaugeMetricFamily("prefix_epp_kv_events_endpoint_usable",
                                   "1 when the endpoint's KV events are usable for precise scoring",
                                   labels=["endpoint"])
        now = m.now()
        for ep in m.datastore.snapshot():
            usable.add_metric([ep.key], 1 if m.usable(ep.key, now) else 0)
        yield usable
        tiers = GaugeMetricFamily("prefix_epp_kv_events_tier_blocks",
                                  "Blocks the endpoint's engine holds per KV cache tier, as its events say",
                                  labels=["endpoint", "tier"])
        for ep in m.datastore.snapshot():
            for tier, name in enumerate(TIERS):
                tiers.add_metric([ep.key, name], idx.held(ep.key, tier))
        yield tiers
        hits = CounterMetricFamily("prefix_epp_kv_events_tier_hit_blocks",
                                   "Matched blocks of the chosen endpoints, by the KV cache tier holding them",
                                   labels=["tier"])
        for tier, name in enumerate(TIERS):
            hits.add_metric([name], m.hits[tier])
        yield hits
        yield CounterMetricFamily("prefix_epp_kv_events_messages", "KV-event messages applied", value=st.messages)
        events = CounterMetricFamily("prefix_epp_kv_events_events", "KV events applied", labels=["type"])
        for name, n in st.events.items():
            events.add_metric([name], n)
        yield events
        blocks = CounterMetricFamily("prefix_epp_kv_events_blocks", "Blocks by index operation", labels=["op"])
        for op, n in (("stored", idx.stored), ("removed", idx.removed), ("orphaned", idx.orphaned),
                      ("evicted", idx.evicted), ("skipped", idx.skipped), ("resolved", idx.resolved)):
            blocks.add_metric([op], n)
        yield blocks
        yield CounterMetricFamily("prefix_epp_kv_events_gaps", "Sequence gaps detected", value=st.gaps)
        yield CounterMetricFamily("prefix_epp_kv_events_restarts",
                                  "Publisher restarts (sequence went back, or a scrape saw the engine restart)",
                                  value=st.restarts)
        replays = CounterMetricFamily("prefix_epp_kv_events_replays", "Replay requests", labels=["outcome"])
        for outcome, n in st.replays.items():
            replays.add_metric([outcome], n)
        yield replays
        dropped = CounterMetricFamily("prefix_epp_kv_events_dropped_messages",
                                      "Live KV-event messages dropped unread (an engine over its byte budget)",
                                      labels=["reason"])
        for reason, n in st.dropped.items():
            dropped.add_metric([reason], n)
        yield dropped
        resyncs = CounterMetricFamily("prefix_epp_kv_events_resyncs", "Entries dropped and endpoint uncertain",
                                      labels=["reason"])
        for reason, n in st.resyncs.items():
            resyncs.add_metric([reason], n)
        yield resyncs
        yield CounterMetricFamily("prefix_epp_kv_events_late_joins", "Publishers first heard after they had "
                                  "published (what they stored before the replay buffer reaches is not indexed)",
                                  value=st.late_joins)
        other = CounterMetricFamily("prefix_epp_kv_events_other_rank_batches",
                                    "Batches whose data_parallel_rank names another rank than their publisher's port",
                                    labels=["outcome"])
        for outcome, n in st.other_rank.items():
            other.add_metric([outcome], n)
        yield other
