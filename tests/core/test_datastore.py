"""The datastore: the engine-restart signal (a scrape whose process start time changed) and the change log."""

from __future__ import annotations

from dataclasses import replace

from extproc.core.changes import LIMIT, Changes
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


def test_the_change_log_names_each_endpoint_whose_load_inputs_changed_in_order() -> None:
    ds = Datastore()
    start = ds.changes.position
    ds.set_endpoints([EndpointSpec("10.0.0.1", 8000), EndpointSpec("10.0.0.2", 8000)])
    a, b = ds.snapshot()
    assert a.changes is ds.changes and b.changes is ds.changes
    mark = ds.changes.position
    assert ds.changes.since(start) == [a.key, b.key]  # added
    ds.acquire(b.key)
    ds.set_metrics(a.key, ModelServerMetrics(waiting=1, updated_at=1.0, ok=True))
    Datastore.release(b)
    Datastore.release(b)  # nothing in flight any more: no change
    ds.upsert(EndpointSpec("10.0.0.1", 8000))  # known already: no change
    assert ds.changes.since(mark) == [b.key, a.key, b.key]
    assert ds.changes.since(ds.changes.position) == []


def test_the_change_log_is_bounded_and_says_when_a_reader_fell_behind() -> None:
    log = Changes()
    log.add("a")
    behind = 0
    for i in range(3 * LIMIT):
        log.add(str(i))
        assert len(log._keys) <= LIMIT
    assert log.since(behind) is None  # what it had not read was dropped: it recomputes everything
    recent = log.position - 10
    assert log.since(recent) == [str(i) for i in range(3 * LIMIT - 10, 3 * LIMIT)]
