"""Calibration: what the latency model's priors get wrong, learned from what the engines report.

slowdown: observed over predicted TTFT, learned per endpoint (LatencyConfig.calibrate). Once a
  scrape shows at least MIN_FIRST_TOKENS new first tokens in vllm:time_to_first_token_seconds since
  the last update, and at least MIN_ROUTED requests were routed there meanwhile:
      ratio = (delta sum / delta count) / (mean base prediction of those routed requests)
      slowdown <- clamp(median of the latest RATIO_WINDOWS (5) ratios, min_slowdown, max_slowdown)
  where a base prediction is the prediction without slowdown: the first window replaces the
  prior (or the pool's calibration), two are averaged, and from three on one window alone (a
  pause of the host) cannot move it (`_move_slowdown`). One scalar absorbs what the priors get
  wrong: a slower GPU, a bigger model.
- bytes per token (pool-wide, for prompts the picker did not tokenize): once a scrape shows at
  least MIN_FIRST_TOKENS new requests in the TTFT histogram and MIN_ROUTED were routed there,
      ratio = (prompt bytes routed / requests routed) / (delta vllm:prompt_tokens_total / delta count)
  clamped to [1, 16]; PrefixConfig.bytes_per_token (4) until then. While it is still the prior, a
  shorter window counts too where it is exact: the engine counted as many new first tokens as
  were routed there since the window opened (so, with one picker, the tokens are those of the
  bytes routed) and at least MIN_EXACT_TOKENS (1,024, so a short probe's template tokens do not
  set it). Its first cold prompt measures it then, not the eighth: on a pool with one replica 4x
  slower, until it was measured the fast replicas' backlogs read 1.6x too long (estimated at 4
  bytes per token, drained at the rate of the tokens they held), the slow one's looked the
  shortest, and the third cold prompt of the start went there. The first window replaces the
  prior, the n-th weighs 1/n (a running mean) until 1/n falls to ALPHA, then ALPHA smooths: a
  prior off by 60% (text that tokenizes unlike English) would otherwise take ten
  windows to fade, mis-sizing every prompt and the index's capacity meanwhile. Means of both
  sides, so peer pickers routing to the same engines do not skew it. (vLLM V1 counts a prompt's
  tokens with its first token, so both counters cover the same requests.)
  Estimates and the slowdown stay in one unit: each move of bytes per token rescales what was
  estimated with the old value (`_rescale`), and a scrape learns bytes per token before it closes
  a TTFT window, so the window that measures it reads its predictions in the measured units. A
  slowdown learned on 4 bytes per token while the text has 6.4 read the engine faster than it
  was, the running mean kept it so for seconds, and cold prompts went to replicas whose queues
  only looked short. (Not read at all, the windows opened at the prior cost more than they
  save: a replica 4x slower is then found later.)


Calibration without the TTFT histogram (an engine that exports none, as many non-vLLM engines):
each response end the picker sees is a sample, for a request whose output length it knows
(max_tokens):
    observed  = (end - routed) - the slot wait charged
    predicted = base(B + uncached) at routing + max_tokens x (decode_step_ms + decode_ms_per_seq x running)
and once MIN_ENDS (8) samples are in, ratio = the median of their observed / predicted, a window as
the histogram's (the slowdown is the median of the latest windows' ratios). The median, not the
ratio of the sums: a response end also holds what is not the engine's (a client that reads its
stream slowly, a pause of the host), and one such sample among eight would move a fast endpoint's
slowdown several-fold; an endpoint read slow is then spared and gets no samples to correct it. A
request that stops before max_tokens reads as a faster engine; the TTFT histogram, where exported,
is used instead. slowdown is clamped to [min_slowdown, max_slowdown] (0.1-50 by default: a CPU
build or an old GPU against an H100 prior). Where neither source is available the prior stands
(`calibration_source` says which one the slowdown comes from). An endpoint
not yet calibrated itself takes the pool's calibration (the geometric mean of the calibrated
endpoints' slowdowns, source "pool") rather than the prior: replicas of one pool mostly run on
like hardware, and a calibrated endpoint weighed against one still at a prior 10x off would win
every decision by the prior's error alone, cache or no cache. Except for an endpoint whose own
window so far (fewer than MIN_FIRST_TOKENS first tokens) reads it faster than the pool's
slowdown: it keeps its slowdown. A pool is not always of like hardware, and the first endpoint
measured slow (by a first-token bound, at its first late request) is likelier the one slower
than the rest: one replica of four at 4x would otherwise make the other three read 2x slow
from its second request on, and the ranking the bound found would be lost.

Before a window closes, first tokens the engine has not produced bound the slowdown from below
(extproc/scheduling/first_token.py): an engine far slower than predicted is seen at its first
overdue request, not after its first MIN_FIRST_TOKENS answers.

A window during which a scrape showed a queue for capacity (slots.py's `engine_says_capacity`:
the engine's vllm:num_requests_waiting_by_reason{reason="capacity"}, or a full KV cache behind a
queue) may lower the slowdown but not raise it: its first tokens may have waited for KV blocks or
a sequence slot, which the base predictions do not hold, and nor does the first-token bound read
such a scrape. (Not the `ceiling` inference, which a slow engine's prefill queue can look like:
the first-token bound's own guard covers slot queues there.) On two real vLLM engines a
conversation's later turns filled a 16k-token KV cache: the engine queued for blocks, its TTFTs
read it 10-17x slower than its twin, and every new conversation went to the twin for the rest of
the run (29 against 11), whose cache then evicted their histories between turns.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from extproc.config.settings import LatencyConfig
from extproc.scheduling.endpoint_work import (
    ALPHA,
    CALIBRATED,
    MAX_BYTES_PER_TOKEN,
    MIN_BYTES_PER_TOKEN,
    MIN_ENDS,
    MIN_EXACT_TOKENS,
    MIN_FIRST_TOKENS,
    MIN_ROUTED,
    EndpointWork,
)
from extproc.scheduling.interfaces import Routing


class Calibration:
    """The calibration half of LatencyModel (extproc/scheduling/latency.py), which holds the state."""

    config: LatencyConfig
    bytes_per_token: float
    pool_limit: float
    pool_version: int
    bpt_rescale: bool  # the switches of --ablate (latency.py)
    median: bool
    window_guard: bool
    pool_calibration: bool
    pool_limit_on: bool
    _bpt_windows: int
    _pool_slowdown: float
    _work: dict[str, EndpointWork]

    def _learn_bytes_per_token(self, w: EndpointWork, prompt_tokens: float, requests: float) -> None:
        if w.requests < 0 or requests < w.requests or prompt_tokens < w.prompt_tokens:
            w.prompt_tokens, w.requests, w.bytes_routed, w.bytes_requests = prompt_tokens, requests, 0.0, 0
            return
        seen = requests - w.requests
        tokens = prompt_tokens - w.prompt_tokens
        # While on the prior, a window whose counted requests are exactly those routed in it
        # measures bytes per token as well as a long one (module docstring).
        exact = self._bpt_windows == 0 and seen == w.bytes_requests and tokens >= MIN_EXACT_TOKENS
        if not exact and (seen < MIN_FIRST_TOKENS or w.bytes_requests < MIN_ROUTED):
            return
        if tokens > 0 and w.bytes_routed > 0:
            ratio = (w.bytes_routed / w.bytes_requests) / (tokens / seen)
            # A running mean until its weight falls to ALPHA's: the prior is only a stand-in.
            self._bpt_windows += 1
            step = max(ALPHA, 1.0 / self._bpt_windows)
            bpt = self.bytes_per_token + step * (ratio - self.bytes_per_token)
            self._rescale(self.bytes_per_token, min(max(bpt, MIN_BYTES_PER_TOKEN), MAX_BYTES_PER_TOKEN))
        w.prompt_tokens, w.requests, w.bytes_routed, w.bytes_requests = prompt_tokens, requests, 0.0, 0

    def _rescale(self, before: float, after: float) -> None:
        """Bytes per token moves from `before` to `after`: a prompt estimated with `before` holds
        r = before / after times the tokens it was taken for. On each endpoint, the share
        `estimated` of its predictions was made in those units, so its estimated quantities (the
        backlog, the mean uncached request, the open window's base sum, the base predictions and
        prompts of its requests awaiting a first token) shrink by
        f = 1 - estimated + estimated x r, and a slowdown it learned on them grows by 1 / f: a
        prediction in ms stays what the engine was measured at, and the slowdown no longer
        carries the old estimate's error into the predictions of new prompts (f scales the
        fixed overhead too; it is small beside a prefill). Without this, the first window's
        move from the prior (4) to real text's 5-7 bytes per token left every slowdown learned
        before it at a fraction of the engine's, for as many windows as the running mean needs
        to dilute it."""
        self.bytes_per_token = after
        r = before / after
        if r == 1.0 or not self.bpt_rescale:
            return
        self.pool_version += 1
        for w in self._work.values():
            f = 1.0 - w.estimated + w.estimated * r
            w.backlog *= f
            w.routed_backlog *= f
            w.mean_uncached *= f
            w.base_sum_ms *= f
            w.first.rescale(f)
            if w.partial_ratio >= 0:
                w.partial_ratio /= f
            if w.calibration_source in CALIBRATED:
                w.slowdown = self._clamped(w.slowdown / f)
                w.window_ratios = deque((r / f for r in w.window_ratios), maxlen=w.window_ratios.maxlen)
        self._share_calibration()

    def _calibrate(self, w: EndpointWork, ttft_sum_s: float, ttft_count: float) -> None:
        if w.ttft_count < 0 or ttft_count < w.ttft_count:  # first sight, or the engine restarted
            w.ttft_sum_s, w.ttft_count, w.base_sum_ms, w.routed = ttft_sum_s, ttft_count, 0.0, 0
            return
        first_tokens = ttft_count - w.ttft_count
        if first_tokens < 1 or w.routed < 1 or w.base_sum_ms <= 0:
            return
        observed_ms = (ttft_sum_s - w.ttft_sum_s) / first_tokens * 1000.0
        predicted_ms = w.base_sum_ms / w.routed
        if first_tokens < MIN_FIRST_TOKENS or w.routed < MIN_ROUTED:
            w.partial_ratio = observed_ms / predicted_ms  # the window so far: too few to calibrate on
            return
        w.partial_ratio = -1.0
        self._move_slowdown(w, self._window_ratio(w, observed_ms / predicted_ms), "ttft-histogram")
        w.ttft_sum_s, w.ttft_count, w.base_sum_ms, w.routed = ttft_sum_s, ttft_count, 0.0, 0

    def _move_slowdown(self, w: EndpointWork, ratio: float, source: str) -> None:
        """A window of `source` closed with `ratio`: the slowdown becomes the median of the latest
        RATIO_WINDOWS windows' ratios (the mean of two). The first window replaces the prior:
        stepping from it, an engine 4x off needs many windows to be measured, which a slow replica
        that the picker rightly spares may never see. The median, not a running mean: one window
        that a pause of the host made 14x (every engine's first tokens 800 ms late at once, on two
        vLLM CPU engines sharing 2 cores with the router) moved a running mean to 6x, and the
        engine, spared from then on, closed no window to correct it; its twin took every new
        conversation. A median needs a second such window to move."""
        w.window_ratios.append(ratio)  # a deque of RATIO_WINDOWS: the oldest drops out
        w.slowdown = self._clamped(statistics.median(w.window_ratios) if self.median else ratio)
        w.calibration_source = source
        self._share_calibration()

    def _clamped(self, slowdown: float) -> float:
        return min(max(slowdown, self.config.min_slowdown), self.config.max_slowdown)

    def _share_limits(self) -> None:
        """The pool's admission limit: the median of those shown (slots.py); run when one changes,
        so its O(endpoints) is paid at a saturated scrape, not per request."""
        if not self.pool_limit_on:
            return
        known = sorted(w.slots.limit for w in self._work.values() if w.slots.limit > 0)
        limit = known[len(known) // 2] if known else -1.0
        if limit != self.pool_limit:
            self.pool_limit = limit
            self.pool_version += 1

    def _share_calibration(self) -> None:
        """Endpoints not calibrated themselves take the pool's slowdown (module docstring); run once
        per calibration window, so its O(endpoints) is off the per-request path."""
        known = [w.slowdown for w in self._work.values() if w.calibration_source in CALIBRATED]
        if not known or not self.pool_calibration:
            return
        self._pool_slowdown = math.exp(sum(math.log(x) for x in known) / len(known))
        pool = self._pool_slowdown
        for w in self._work.values():
            if w.calibration_source not in CALIBRATED and not 0 <= w.partial_ratio < pool:
                if w.slowdown != pool:
                    self.pool_version += 1
                w.slowdown, w.calibration_source = pool, "pool"

    def _calibrate_from_end(self, w: EndpointWork, elapsed_ms: float, routing: Routing) -> None:
        """One response end as a calibration sample where the engine exports no TTFT histogram."""
        predicted = routing.base_ms + routing.decode_ms
        if predicted <= 0:
            return
        ratios = w.end_ratios
        ratios.append(max(0.0, elapsed_ms - routing.wait_ms) / predicted)
        if len(ratios) < MIN_ENDS:
            return
        median = statistics.median(ratios)
        ratios.clear()
        self._move_slowdown(w, self._window_ratio(w, median), "response-ends")

    def _window_ratio(self, w: EndpointWork, ratio: float) -> float:
        """A closing window's observed / predicted ratio, as far as it proves anything: where a
        scrape during it showed a capacity queue, its requests may have waited for KV blocks or a
        slot that no prediction charged, so it is an upper bound on the engine's slowdown (it may
        lower it, not raise it)."""
        if w.saturated_window:
            w.saturated_window = False
            return min(ratio, w.slowdown) if self.window_guard else ratio
        return ratio
