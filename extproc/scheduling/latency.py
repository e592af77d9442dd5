"""Token-aware load and predicted time to first token (TTFT), per endpoint.

State per endpoint (`EndpointWork`), kept from the picker's own decisions and corrected by each
scrape that the request path finds newer than the last one it saw (the scraper only writes the
datastore; nothing here runs off the request path):

- backlog B: prompt tokens routed to the endpoint that it has not prefilled yet. A routed request
  adds its uncached tokens (prompt tokens minus those the prefix index predicts cached there).
  B drains at the endpoint's prefill rate while it is not empty:
      B(t) = max(0, B(t0) - (t - t0) / (prefill_ms_per_token x slowdown))
- slowdown: observed over predicted TTFT, learned per endpoint, and bytes per token, learned for
  the pool (extproc/scheduling/calibration.py).

- churn: the uncached tokens routed to the endpoint, each decaying with a half-life of
  CHURN_HALF_LIFE_S (120 s): what its cache had to insert lately. A full LRU cache keeps a block
  for about capacity / insertion rate, so where churn is lower a new prefix survives longer.
  The decay lets an endpoint that joined later (churn 0) catch up within minutes instead of
  drawing new prefixes for as long as the process runs.

A finished request (its response ended) had its prefill done, and so had everything routed there
before it (FIFO): B <= tokens routed there after it.

Scrape corrections of B (the engine sees first tokens, the picker does not):
- waiting = 0 and running = 0: the engine is idle, so only requests routed since the scrape before
  can be waiting: B <= tokens routed since then. (Not since this scrape: a request routed just
  before it landed may have reached the engine only after the engine was sampled.)
- waiting > 0: at least that many requests wait: B >= waiting x the mean uncached tokens of the
  requests routed there (exponentially weighted, ALPHA).

Prefixes still being computed count as cached: an engine caches a prompt's blocks as soon as the
chunk computing them is scheduled (vLLM V1's allocate_slots), and a request routed behind it is
admitted no earlier (FIFO), so it hits them even in the same step.

Prediction for a request with `uncached` tokens not cached on e, running_e sequences there
(extproc/scheduling/load.py's load):

    base(work) = overhead_ms + work x prefill_ms_per_token
                 + ceil(work / step_tokens) x decode_ms_per_seq x running_e
    ttft(e)    = max(slowdown_e x base(B_e + uncached),  wait_e + slowdown_e x base(uncached))

An engine step prefills at most step_tokens, and every step also decodes the running sequences:
that is the decode-contention term. wait_e is the expected wait for a free sequence slot where
e's admission limit is reached (extproc/scheduling/slots.py; 0 while its limit or occupancy is
unknown): a request queued for capacity waits for slots, not for the prefill ahead of it, so the
larger of the two queues counts, never both. Prompt tokens are exact when the request was
tokenized (precise mode), else prompt bytes / PrefixConfig.bytes_per_token (slowdown absorbs the
error).

With several active-active pickers each backlog holds only its own decisions; the scrape
corrections and the TTFT calibration see every picker's traffic, at scrape granularity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from extproc.config.settings import ABLATIONS, LatencyConfig
from extproc.core.datastore import Endpoint, ModelServerMetrics
from extproc.scheduling.calibration import Calibration
from extproc.scheduling.endpoint_work import ALPHA, CHURN_HALF_LIFE_S, EndpointWork
from extproc.scheduling.first_token import FirstTokenWait
from extproc.scheduling.interfaces import Routing
from extproc.scheduling.load import endpoint_load
from extproc.scheduling.slots import SlotState

# A request's late first token bounds the slowdown only if its base is at least this many times
# the fixed overhead (first_token.py): below, most of what it waits for is not prefill.
READABLE_OVERHEADS = 2.0


class LatencyModel(Calibration):
    def __init__(self, config: LatencyConfig, bytes_per_token: float, clock: Callable[[], float]) -> None:
        if config.prefill_ms_per_token <= 0 or config.step_tokens <= 0:
            raise ValueError("latency: prefill_ms_per_token and step_tokens must be positive")
        if not 0 < config.min_slowdown <= 1 <= config.max_slowdown:
            raise ValueError("latency: min_slowdown must be in (0, 1] and max_slowdown >= 1")
        if unknown := [name for name in config.ablate if name not in ABLATIONS]:
            raise ValueError(f"latency: unknown ablation {', '.join(unknown)}; known: {', '.join(ABLATIONS)}")
        # Benchmark-only switches (--ablate, docs/ablation.md), read once here: each True is the default.
        off = set(config.ablate)
        self.idle_bound, self.waiting_floor = "idle-bound" not in off, "waiting-floor" not in off
        self.finish_drain, self.learn_bpt = "finish-drain" not in off, "bytes-per-token" not in off
        self.bpt_rescale, self.median = "bpt-rescale" not in off, "calibration-median" not in off
        self.window_guard, self.pool_calibration = "capacity-window-guard" not in off, "pool-calibration" not in off
        self.end_calibration, self.first_bound = "response-end-calibration" not in off, "first-token-bound" not in off
        self.first_capacity_guard = "first-token-capacity-guard" not in off
        self.first_step_share, self.first_floor = "first-token-step-share" not in off, "first-token-floor" not in off
        self.pool_limit_on = "pool-limit" not in off
        self._first_args = ("first-token-twice" not in off, "first-token-slot-guard" not in off,
                            "first-token-readable" not in off)
        self._slot_args = ("slot-wait" not in off, "slot-ages" not in off, "slot-ceiling" not in off)
        if "decode-contention" in off:
            config = replace(config, decode_ms_per_seq=0.0)
        self.config = config
        self.bytes_per_token = bytes_per_token
        self._bpt_windows = 0  # bytes-per-token windows measured so far (pool-wide)
        self.clock = clock
        self._work: dict[str, EndpointWork] = {}
        self._pool_slowdown = 1.0  # the calibrated endpoints' geometric mean (_share_calibration)
        self._tokens = 0  # the last token handed out by `admit`
        self.pool_limit = -1.0  # the median admission limit the endpoints showed (slots.py); -1: none yet
        self.pool_peak_running = 0.0  # the most running sequences any endpoint was seen to hold
        # Bumped whenever a pool-wide quantity moves (the pool's admission limit or slowdown,
        # bytes per token): every endpoint's prediction may have changed (queue_ranking.py).
        self.pool_version = 0
        # Endpoints whose state a single-endpoint call changed (a request routed, answered,
        # moved) since the queue ranking last read them; bounded by the states kept.
        self.touched: set[str] = set()

    def _slots(self) -> SlotState:
        waits, ages, ceiling = self._slot_args
        return SlotState(waits=waits, ages=ages, ceiling=ceiling)

    # -- per-endpoint state ------------------------------------------------------------------
    def work(self, ep: Endpoint, now: float) -> EndpointWork:
        """The endpoint's state, drained to `now` and corrected by a scrape not yet applied; the
        caller may change it (the endpoint counts as touched)."""
        self.touched.add(ep.key)
        return self.works((ep,), now)[0]

    def works(self, endpoints: Sequence[Endpoint], now: float) -> list[EndpointWork]:
        """`work` for each endpoint, in order: one call per decision rather than one per
        candidate (the scorer's per-endpoint cost at 256 endpoints), same arithmetic."""
        states = self._work
        per_ms = self.config.prefill_ms_per_token
        decay_dt, decay = -1.0, 1.0  # the churn factor of the last interval (usually one `now` for all)
        out = []
        for ep in endpoints:
            w = states.get(ep.key)
            if w is None:
                w = states[ep.key] = EndpointWork(updated_at=now, slowdown=self._pool_slowdown,
                                                  slots=self._slots(),
                                                  first=FirstTokenWait(*self._first_args))
                if self._pool_slowdown != 1.0:
                    w.calibration_source = "pool"
            if now > w.updated_at:
                dt = now - w.updated_at
                drained = dt / (per_ms * w.slowdown) * 1000.0
                left = w.backlog - drained  # max(0.0, left) without the call, as below
                w.backlog = left if left > 0.0 else 0.0
                left = w.routed_backlog - drained
                w.routed_backlog = left if left > 0.0 else 0.0
                if dt != decay_dt:
                    decay_dt, decay = dt, 0.5 ** (dt / CHURN_HALF_LIFE_S)
                w.churn *= decay
                w.updated_at = now
            m = ep.metrics
            if m is not None and m.ok and m.updated_at > w.seen_scrape_at:
                self._apply_scrape(w, m)
            out.append(w)
        return out

    def _apply_scrape(self, w: EndpointWork, m: ModelServerMetrics) -> None:
        """Correct the state by a scrape the request path sees for the first time (module docstring)."""
        w.seen_scrape_at = m.updated_at
        # The queue's share that the prefill routed there explains (slots.py); not the
        # corrected backlog, which a scrape's waiting requests raise by themselves.
        limit = w.slots.limit
        w.slots.observe(m, w.routed_backlog / w.mean_uncached if w.mean_uncached > 0 else 0.0)
        capacity = w.slots.engine_says_capacity  # a queue for KV blocks or slots: waits, not slowness
        if capacity:
            w.saturated_window = True
        if w.slots.limit != limit:
            self._share_limits()
        if w.slots.peak_running > self.pool_peak_running:
            self.pool_peak_running = w.slots.peak_running
        if m.waiting <= 0 and m.running <= 0:
            if self.idle_bound:
                w.backlog = min(w.backlog, w.routed_tokens_since_scrape + w.routed_tokens_before)
                w.routed_backlog = min(w.routed_backlog, w.backlog)
        elif m.waiting > 0 and self.waiting_floor:
            w.backlog = max(w.backlog, m.waiting * w.mean_uncached)
        w.routed_tokens_before, w.routed_tokens_since_scrape = w.routed_tokens_since_scrape, 0.0
        if m.prompt_tokens >= 0 and m.ttft_count >= 0 and self.learn_bpt:
            self._learn_bytes_per_token(w, m.prompt_tokens, m.ttft_count)
        if self.config.calibrate and m.ttft_count >= 0:
            # After bytes per token: a window that measured it reads its predictions rescaled to it.
            self._calibrate(w, m.ttft_sum_s, m.ttft_count)
            if not self.first_bound:
                return
            # First tokens overdue (first_token.py): at least this slow, unless a late one may
            # have waited for a slot rather than for prefill.
            c = self.config
            # A queue with every slot taken (the admission limit shown, or the pool's): a request
            # routed before it may have waited for a slot, admitted or not by a later scrape.
            slot_queue = m.waiting > 0 and w.slots.may_wait(m.running, self.pool_limit)
            late, unfinished = w.first.observe(m.ttft_count, m.updated_at, w.slowdown, queue=m.waiting > 0,
                                               step_tokens=c.step_tokens if self.first_step_share else 0,
                                               ms_per_token=c.prefill_ms_per_token,
                                               capacity=capacity and self.first_capacity_guard,
                                               slot_queue=slot_queue)
            if late is not None:
                w.slowdown, w.calibration_source = self._clamped(late), "first-token-wait"
                self._share_calibration()
            if not self.first_floor:
                return
            w.backlog = max(w.backlog, unfinished)
            w.routed_backlog = max(w.routed_backlog, min(unfinished, w.backlog))

    def snapshot(self, now: float) -> list[tuple[str, float, float, SlotState]]:
        """(endpoint, backlog drained to `now`, slowdown, slot state) per endpoint, without
        changing the state."""
        out = []
        for key, w in self._work.items():
            drained = max(0.0, now - w.updated_at) / (self.config.prefill_ms_per_token * w.slowdown) * 1000.0
            out.append((key, max(0.0, w.backlog - drained), w.slowdown, w.slots))
        return out

    def forget_others(self, keep: Sequence[Endpoint]) -> None:
        """Drop the state of endpoints not in `keep` (bounded by the pool, not by its history)."""
        wanted = {ep.key for ep in keep}
        for key in [k for k in self._work if k not in wanted]:
            del self._work[key]
        self.touched &= wanted

    def __len__(self) -> int:
        return len(self._work)

    # -- predictions -------------------------------------------------------------------------
    def prompt_tokens(self, prompt_tokens: int, prompt_bytes: int) -> float:
        return float(prompt_tokens) if prompt_tokens > 0 else prompt_bytes / self.bytes_per_token

    def base_ttft_ms(self, ep: Endpoint, w: EndpointWork, uncached: float, backlog: bool = True,
                     load: float | None = None) -> float:
        """Predicted TTFT without the endpoint's slowdown (see the module docstring); `backlog`
        False: as if the request were admitted now, after its wait for a slot. `load`: the
        endpoint's load when the caller has it already."""
        c = self.config
        work = (w.backlog if backlog else 0.0) + uncached
        steps = max(1.0, math.ceil(work / c.step_tokens))
        running = endpoint_load(ep) if load is None else load
        return c.overhead_ms + work * c.prefill_ms_per_token + steps * c.decode_ms_per_seq * running

    def predict(self, ep: Endpoint, w: EndpointWork, uncached: float) -> tuple[float, float, float]:
        """(predicted TTFT, its base without slowdown and slot wait, the slot wait), in ms."""
        load = endpoint_load(ep)
        base = self.base_ttft_ms(ep, w, uncached, load=load)
        wait = w.slots.wait_ms(load, w.updated_at, self.pool_limit)  # work() drained w to now
        ttft = w.slowdown * base
        if wait > 0:
            ttft = max(ttft, wait + w.slowdown * self.base_ttft_ms(ep, w, uncached, backlog=False, load=load))
        return ttft, base, wait

    def predict_ttfts(self, endpoints: Sequence[Endpoint], works: Sequence[EndpointWork],
                      uncached: Sequence[float], loads: Sequence[float] | None = None) -> list[float]:
        """`predict(...)[0]` for each endpoint, in one loop: base_ttft_ms inlined with the config
        read once, the slot wait asked only where a limit and the occupancy are known (0 otherwise,
        as wait_ms says); `loads`: each endpoint's load when the caller has them already.
        The same arithmetic in the same order, so the same floats (tests/scheduling/test_latency.py)."""
        c = self.config
        overhead, per_token, step, per_seq = c.overhead_ms, c.prefill_ms_per_token, c.step_tokens, c.decode_ms_per_seq
        ceil, pool_limit = math.ceil, self.pool_limit
        if loads is None:
            loads = [endpoint_load(ep) for ep in endpoints]
        out = []
        for w, u, load in zip(works, uncached, loads, strict=True):
            work = w.backlog + u
            steps = ceil(work / step)
            ttft = w.slowdown * (overhead + work * per_token + (steps if steps > 1.0 else 1.0) * per_seq * load)
            slots = w.slots
            # Else wait_ms is 0: no limit, or no occupancy and no ages to bound it.
            if (slots.limit > 0 or pool_limit > 0) and (slots.occupancy_ms >= 0 or slots.admitted):
                wait = slots.wait_ms(load, w.updated_at, pool_limit)
                if wait > 0:
                    steps = ceil(u / step)
                    base = overhead + u * per_token + (steps if steps > 1.0 else 1.0) * per_seq * load
                    alone = wait + w.slowdown * base
                    if alone > ttft:
                        ttft = alone
            out.append(ttft)
        return out

    def moves_with_time(self, w: EndpointWork, load: float) -> bool:
        """Whether `predict_ttfts` for this state can change with time alone (nothing routed,
        answered or scraped): only a backlog draining or a slot wait whose holders age do; the
        rest of the prediction reads what only those events change."""
        return w.backlog > 0.0 or w.slots.may_wait(load, self.pool_limit)

    def decode_ms(self, ep: Endpoint, output_tokens: int) -> float:
        """Predicted decode time of `output_tokens` on `ep` without slowdown; -1 when unknown."""
        if output_tokens <= 0:
            return -1.0
        c = self.config
        return output_tokens * (c.decode_step_ms + c.decode_ms_per_seq * endpoint_load(ep))

    def describe(self, ep: Endpoint, w: EndpointWork, wait_ms: float) -> str:
        """The signals a prediction for `ep` used (--explain-decisions)."""
        m = ep.metrics
        queue = "scraped" if m is not None and m.ok else "unknown"
        return (f"{w.slots.describe(self.pool_limit)} slot_wait={wait_ms:.0f}ms queue={queue} "
                f"slowdown={w.slowdown:.2f}({w.calibration_source})")

    def response_ended(self, ep: Endpoint, routing: Routing, now: float) -> None:
        """The response of a request routed to `ep` (as `routing` says) ended at `now`: learn its
        occupancy, and calibrate from it where the engine exports no TTFT histogram."""
        w = self.work(ep, now)
        elapsed_ms = max(0.0, now - routing.at) * 1000.0
        w.slots.leave(routing.token)
        w.first.remove(routing.token)
        w.slots.finished(elapsed_ms, routing.wait_ms)
        m = ep.metrics
        if (self.config.calibrate and self.end_calibration and routing.decode_ms >= 0
                and (m is None or m.ttft_count < 0)):
            self._calibrate_from_end(w, elapsed_ms, routing)

    def routed(self, ep: Endpoint, uncached: float, base_ms: float | None, now: float,
               prompt_bytes: int = 0, estimated: bool = True) -> None:
        """A request with `uncached` tokens to prefill was routed to `ep`, predicted at base_ms
        (None: not this picker's prediction, e.g. a fallback that served; not calibrated on);
        `estimated`: its tokens were estimated from its bytes, not counted by a tokenizer."""
        w = self.work(ep, now)
        w.estimated += ALPHA * ((1.0 if estimated else 0.0) - w.estimated)
        w.backlog += uncached
        w.routed_backlog += uncached
        w.routed_total += uncached
        w.churn += uncached
        w.routed_tokens_since_scrape += uncached
        w.mean_uncached += ALPHA * (uncached - w.mean_uncached)
        if base_ms is not None:
            w.base_sum_ms += base_ms
            w.routed += 1
        if prompt_bytes > 0:
            w.bytes_routed += prompt_bytes
            w.bytes_requests += 1

    def admit(self, ep: Endpoint, now: float, base_ms: float, wait_ms: float, uncached: float = 0.0) -> int:
        """Remember a request routed to `ep` at `now`, predicted at `base_ms` after a slot wait of
        `wait_ms`, among its in-flight ones (slots.py's ages) and those awaiting a first token
        (first_token.py); the token to pass to `leave` (or in its Routing to `response_ended`)."""
        self._tokens += 1
        w = self.work(ep, now)
        w.slots.admit(self._tokens, now)
        # Admitted on arrival where it finds fewer requests there than the pool was seen to run
        # at once (first_token.py; the first request to an idle endpoint always is), unless the
        # endpoint's last scrape showed a queue for capacity (the engine's own gauge, or a full KV
        # cache): a KV-cache limit admits fewer sequences as the prompts grow (a conversation's
        # later turns), so the count seen once proves nothing.
        queued = endpoint_load(ep) >= max(1.0, self.pool_peak_running) or w.slots.engine_says_capacity
        # Its lateness reads prefill speed only where prefill is most of the prediction (first_token.py).
        readable = base_ms >= READABLE_OVERHEADS * self.config.overhead_ms
        w.first.add(self._tokens, now, base_ms, wait_ms, uncached, queued, readable)
        return self._tokens

    def leave(self, ep: Endpoint, token: int) -> None:
        w = self._work.get(ep.key)
        if w is not None:
            self.touched.add(ep.key)
            w.slots.leave(token)
            w.first.remove(token)

    def mark(self, ep: Endpoint) -> float:
        """The endpoint's routed-token count now (a request's mark right after it was routed)."""
        w = self._work.get(ep.key)
        return w.routed_total if w is not None else 0.0

    def finished(self, ep: Endpoint, mark: float, now: float) -> None:
        """The request routed to `ep` at `mark` has answered, so its prefill is done, and that of
        everything queued before it (FIFO): at most the tokens routed after it remain."""
        w = self.work(ep, now)
        if not self.finish_drain:
            return
        w.backlog = max(0.0, min(w.backlog, w.routed_total - mark))
        w.routed_backlog = min(w.routed_backlog, w.backlog)

    def unrouted(self, ep: Endpoint, uncached: float, now: float) -> None:
        """A request routed to `ep` went elsewhere (a fallback served it): take its work back."""
        w = self.work(ep, now)
        w.backlog = max(0.0, w.backlog - uncached)
        w.routed_backlog = max(0.0, w.routed_backlog - uncached)
        w.routed_tokens_since_scrape = max(0.0, w.routed_tokens_since_scrape - uncached)
        w.routed_tokens_before = max(0.0, w.routed_tokens_before - uncached)
