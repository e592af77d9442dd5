"""The sidecar's own metrics, served on `--metrics-port` (off by default; /metrics on `--port` is the
decode engine's, which the picker scrapes through the sidecar).

  prefix_epp_sidecar_requests_total{mode, outcome}
      mode: disaggregated (a prefill ran first, or was refused) | forwarded (to the decode engine only)
      outcome: ok | engine_error (the engine's answer was 4xx/5xx) | prefill_error (the prefill's
      4xx/5xx, passed back) | prefill_unreachable | prefill_timeout | prefill_invalid |
      decode_unreachable | decode_cut (the engine failed mid-answer) | client_gone | refused (400, 413)
  prefix_epp_sidecar_prefill_duration_seconds{outcome}  histogram of prefill requests
      outcome: ok | error | unreachable | timeout | invalid

One registry per sidecar (never prometheus_client's global one), so tests can run several.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

PREFILL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class SidecarMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("prefix_epp_sidecar_requests", "Requests the sidecar handled, by mode and outcome.",
                                ["mode", "outcome"], registry=self.registry)
        self.prefill_seconds = Histogram("prefix_epp_sidecar_prefill_duration_seconds",
                                         "Duration of prefill requests, by outcome.", ["outcome"],
                                         buckets=PREFILL_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
