"""Endpoints in and out of rotation (extproc/control/health.py), and what a failed response teaches."""

from __future__ import annotations

import logging

import pytest

from extproc.config.settings import OutlierConfig
from extproc.control.health import Rotation
from extproc.core.datastore import Datastore, EndpointSpec, ModelServerMetrics
from extproc.pb import external_processor_pb2 as pb
from extproc.scheduling.scorers.predicted_ttft import PredictedTtftScorer
from testkit.extproc_stream import BUFFERED, body_msgs, completion, destination, drive, headers_msg, make_app
from testkit.scheduling import Clock

CFG = OutlierConfig(consecutive_failures=3, base_ejection_s=2.0, max_ejection_s=5.0)


def pool(n: int = 3) -> Datastore:
    ds = Datastore()
    ds.set_endpoints(EndpointSpec(f"10.0.0.{i}", 8000) for i in range(1, n + 1))
    return ds


def keys(eps: object) -> list[str]:
    return [ep.key for ep in eps]  # type: ignore[attr-defined]


def test_a_failing_scrape_takes_an_endpoint_out_until_one_succeeds() -> None:
    ds = pool()
    rot = Rotation(CFG, ds, Clock())
    a, b, c = ds.snapshot()
    assert keys(rot.candidates(ds.snapshot())) == [a.key, b.key, c.key]  # never scraped: in rotation
    ds.set_metrics(b.key, ModelServerMetrics(ok=False))
    assert keys(rot.candidates(ds.snapshot())) == [a.key, c.key]
    assert not rot.in_rotation(b)
    ds.set_metrics(b.key, ModelServerMetrics(ok=True))
    assert keys(rot.candidates(ds.snapshot())) == [a.key, b.key, c.key]
    assert rot.fail_open_decisions == 0


def test_every_endpoint_failing_fails_open_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    ds = pool(2)
    rot = Rotation(CFG, ds, Clock())
    for ep in ds.snapshot():
        ds.set_metrics(ep.key, ModelServerMetrics(ok=False))
    with caplog.at_level(logging.WARNING, logger="prefix_epp.health"):
        for _ in range(3):
            assert len(rot.candidates(ds.snapshot())) == 2
    assert rot.fail_open_decisions == 3
    assert sum("every candidate endpoint is failing" in r.message for r in caplog.records) == 1
    ds.set_metrics(ds.snapshot()[0].key, ModelServerMetrics(ok=True))
    assert len(rot.candidates(ds.snapshot())) == 1
    assert rot.fail_open_decisions == 3


def test_consecutive_failures_eject_then_probation_then_a_success_clears() -> None:
    clock = Clock()
    ds = pool(2)
    rot = Rotation(CFG, ds, clock)
    a, b = ds.snapshot()
    rot.outcome(a, False)
    rot.outcome(a, False)
    rot.outcome(a, True)  # a success in between starts the count again
    rot.outcome(a, False)
    rot.outcome(a, False)
    assert keys(rot.candidates(ds.snapshot())) == [a.key, b.key]
    rot.outcome(a, False)  # the third in a row
    assert keys(rot.candidates(ds.snapshot())) == [b.key] and rot.ejections_total == 1
    clock.now += 1.9
    assert keys(rot.candidates(ds.snapshot())) == [b.key]
    clock.now += 0.2  # 2 s: back, on probation
    assert keys(rot.candidates(ds.snapshot())) == [a.key, b.key]
    rot.outcome(a, False)  # one failure on probation ejects it again, for twice as long
    assert keys(rot.candidates(ds.snapshot())) == [b.key] and rot.ejections_total == 2
    clock.now += 3.9
    assert keys(rot.candidates(ds.snapshot())) == [b.key]
    clock.now += 0.2
    assert keys(rot.candidates(ds.snapshot())) == [a.key, b.key]
    rot.outcome(a, False)  # third ejection: 8 s, capped at 5
    clock.now += 5.1
    assert keys(rot.candidates(ds.snapshot())) == [a.key, b.key]
    rot.outcome(a, True)  # a success ends the probation and the back-off
    rot.outcome(a, False)
    rot.outcome(a, False)
    assert keys(rot.candidates(ds.snapshot())) == [a.key, b.key]
    rot.outcome(a, False)
    clock.now += 2.1  # the back-off started again at 2 s
    assert keys(rot.candidates(ds.snapshot())) == [a.key, b.key]


def test_zero_failures_never_ejects_and_a_removed_endpoint_leaves_no_state() -> None:
    ds = pool(2)
    off = Rotation(OutlierConfig(consecutive_failures=0), ds, Clock())
    a = ds.snapshot()[0]
    for _ in range(10):
        off.outcome(a, False)
    assert len(off.candidates(ds.snapshot())) == 2
    rot = Rotation(CFG, ds, Clock())
    for _ in range(3):
        rot.outcome(a, False)
    assert len(rot.candidates(ds.snapshot())) == 1
    ds.remove(a.key)
    assert rot._records == {} and rot._ejected == {}
    rot.outcome(a, False)  # a late outcome of an endpoint discovery forgot: no record made
    assert rot._records == {}


def response_headers(status: int) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    h = msg.response_headers.headers.headers.add()
    h.key, h.raw_value = ":status", str(status).encode()
    return msg


def trailers() -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    msg.response_trailers.SetInParent()
    return msg


async def test_a_5xx_response_ejects_counts_by_status_and_teaches_nothing() -> None:
    app = make_app(2, outlier=OutlierConfig(consecutive_failures=2, base_ejection_s=60.0))
    scorer = next(o for o in app.scheduler.observers if isinstance(o, PredictedTtftScorer))
    prompt = completion("The same long system prompt for every request. " * 8)
    first = await drive(app, [headers_msg(body_mode=BUFFERED), *body_msgs(prompt), response_headers(500), trailers()])
    failed = destination(first[1])
    ep = app.datastore.get(failed)
    assert ep is not None and ep.inflight == 0
    assert app.index is not None and app.index.entries == 0  # its record of the prompt forgotten
    work = scorer.model._work.get(failed)
    assert work is None or work.slots.occupancy_ms < 0  # no occupancy learnt from a failure
    second = await drive(app, [headers_msg(body_mode=BUFFERED), *body_msgs(prompt), response_headers(503), trailers()])
    assert destination(second[1]) == failed  # its failed record was forgotten: no pull, but still the choice
    # Two failures in a row: ejected; every later request goes to the other endpoint.
    for _ in range(4):
        out = await drive(app, [headers_msg(body_mode=BUFFERED), *body_msgs(prompt), response_headers(200), trailers()])
        assert destination(out[1]) != failed
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in app.metrics.registry.collect() for s in fam.samples}
    assert samples[("prefix_epp_requests_total", (("outcome", "routed"), ("status", "500")))] == 1
    assert samples[("prefix_epp_requests_total", (("outcome", "routed"), ("status", "503")))] == 1
    assert samples[("prefix_epp_requests_total", (("outcome", "routed"), ("status", "200")))] == 4
    assert samples[("prefix_epp_endpoint_ejections_total", ())] == 1
    assert samples[("prefix_epp_endpoint_in_rotation", (("endpoint", failed),))] == 0
