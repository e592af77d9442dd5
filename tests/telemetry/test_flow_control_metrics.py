"""Flow control's metrics: the fairness_id label is bounded, queue gauges stay once exported."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.config.flow_control import FlowControlConfig
from extproc.core.datastore import Datastore, EndpointSpec
from extproc.flowcontrol.controller import FlowController, FlowRequest
from extproc.flowcontrol.detectors import ConcurrencyDetector
from extproc.telemetry.flow_control import OVERFLOW, FlowControlMetrics


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def test_fairness_ids_beyond_the_limit_share_one_label_and_gauges_fall_to_zero() -> None:
    ds = Datastore()
    ds.set_endpoints([EndpointSpec("10.0.0.1", 8000)])
    fc = FlowController(replace(FlowControlConfig(enabled=True), max_fairness_labels=2), ds, ConcurrencyDetector(1))
    registry = CollectorRegistry()
    fc.observer = FlowControlMetrics(registry, fc)
    await fc.submit(FlowRequest("busy", 0, 1), lambda: ds.acquire("10.0.0.1:8000"))
    held = [asyncio.create_task(fc.submit(FlowRequest(f"t{i}", 0, 10), lambda: None)) for i in range(4)]
    while fc.count < 4:
        await asyncio.sleep(0.001)
    m = samples(registry)
    size = {labels: v for (name, labels), v in m.items() if name == "prefix_epp_flow_control_queue_size"}
    # "busy" took the first label, "t0" the second; t1-t3 share the overflow value.
    assert size == {(("fairness_id", "t0"), ("priority", "0")): 1.0,
                    (("fairness_id", OVERFLOW), ("priority", "0")): 3.0}
    assert m[("prefix_epp_flow_control_pool_saturation", ())] == 1.0
    await fc.close()
    await asyncio.gather(*held, return_exceptions=True)
    m = samples(registry)
    assert m[("prefix_epp_flow_control_queue_size", (("fairness_id", OVERFLOW), ("priority", "0")))] == 0.0
    assert m[("prefix_epp_flow_control_requests_total", (("outcome", "EvictedOther"), ("priority", "0")))] == 4.0
    assert m[("prefix_epp_flow_control_requests_total", (("outcome", "Dispatched"), ("priority", "0")))] == 1.0
