"""`EndpointWork`: what the latency model (extproc/scheduling/latency.py) keeps per endpoint, and
the constants of its calibration (extproc/scheduling/calibration.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from extproc.scheduling.first_token import FirstTokenWait
from extproc.scheduling.slots import SlotState

ALPHA = 0.2
MIN_FIRST_TOKENS = 8
MIN_ROUTED = 4
MIN_BYTES_PER_TOKEN = 1.0
MAX_BYTES_PER_TOKEN = 16.0
CHURN_HALF_LIFE_S = 120.0
MIN_ENDS = 8
MIN_EXACT_TOKENS = 1024  # the least prompt tokens of a first bytes-per-token window that is exact
RATIO_WINDOWS = 5  # the slowdown is the median of this many latest windows' ratios (calibration.py)
# Calibration sources measured on the endpoint itself.
CALIBRATED = ("ttft-histogram", "response-ends", "first-token-wait")



@dataclass(slots=True)
class EndpointWork:
    backlog: float = 0.0  # tokens not yet prefilled
    routed_backlog: float = 0.0  # the same from this picker's routing alone, without scrape corrections
    routed_total: float = 0.0  # tokens ever routed here (a request's mark counts in it)
    updated_at: float = 0.0  # when backlog was last drained
    churn: float = 0.0  # tokens recently inserted into its cache (see the module docstring)
    slowdown: float = 1.0
    mean_uncached: float = 0.0
    # Share of the requests routed here whose prompt tokens were estimated from bytes (not tokenized),
    # exponentially weighted (ALPHA): how much of its predictions, and so of its slowdown, is in
    # units of the pool's bytes per token (calibration.py, rescale).
    estimated: float = 1.0
    routed_tokens_since_scrape: float = 0.0
    routed_tokens_before: float = 0.0  # in the interval before the last scrape
    seen_scrape_at: float = -1.0  # updated_at of the last scrape applied
    # Calibration window: engine counters at its start, our routed requests since.
    ttft_sum_s: float = 0.0
    ttft_count: float = -1.0
    base_sum_ms: float = 0.0
    routed: int = 0
    # The latest windows' observed / predicted ratios (TTFT histogram or response ends), at most
    # RATIO_WINDOWS, oldest first: the slowdown is their median.
    window_ratios: deque[float] = field(default_factory=lambda: deque(maxlen=RATIO_WINDOWS))
    partial_ratio: float = -1.0  # observed / predicted TTFT of the window so far (fewer first tokens); -1: none
    # A scrape during the open window (TTFT or response ends) showed a queue for capacity
    # (slots.py's `engine_says_capacity`): its requests may have waited for KV blocks or a slot,
    # which no prediction charged, so it can prove the engine faster, never slower (calibration.py).
    saturated_window: bool = False
    # Bytes-per-token window: engine counters at its start, our routed prompts since.
    prompt_tokens: float = -1.0
    requests: float = -1.0
    bytes_routed: float = 0.0
    bytes_requests: int = 0
    # Response-end calibration window (no TTFT histogram): observed / predicted per sample (<= MIN_ENDS).
    end_ratios: list[float] = field(default_factory=list)
    calibration_source: str = "prior"  # "prior", "pool", "ttft-histogram", "response-ends", "first-token-wait"
    slots: SlotState = field(default_factory=SlotState)
    first: FirstTokenWait = field(default_factory=FirstTokenWait)  # requests without a first token yet
