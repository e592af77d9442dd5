"""The datastore's engine-restart signal: a scrape whose process start time changed."""

from __future__ import annotations

from dataclasses import replace

from extproc.core.datastore import Datastore, EndpointSpec, ModelServerMetrics


def test_a_changed_process_start_time_is_a_restart_and_nothing_else_is() -> None:
    ds = Datastore()
    ds.set_endpoints([EndpointSpec("10.0.0.1", 8000)])
    restarted: list[str] = []
    ds.on_restarted(lambda ep: restarted.append(ep.key))
    first = ModelServerMetrics(ok=True, started_at=1000.0)
    ds.set_metrics("10.0.0.1:8000", first)  # the first scrape: no earlier process to compare
    ds.set_metrics("10.0.0.1:8000", replace(first, waiting=3))
    ds.set_metrics("10.0.0.1:8000", replace(first, ok=False))  # down while it restarts
    assert restarted == []
    ds.set_metrics("10.0.0.1:8000", replace(first, started_at=1060.0))
    assert restarted == ["10.0.0.1:8000"]
    ds.set_metrics("10.0.0.1:8000", replace(first, started_at=-1.0))  # no longer exported: unknown
    ds.set_metrics("10.0.0.1:8000", replace(first, started_at=1060.0))
    assert restarted == ["10.0.0.1:8000"]
