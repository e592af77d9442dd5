"""The director: from a parsed request to a routing decision, the picker's request-path logic.

route(ctx):
1. Parse the body (400 on invalid JSON, a non-object or a missing model).
2. Resolve the request's priority from its InferenceObjective header.
3. Candidates: the datastore's endpoints, narrowed by the proxy's subset hint and, where the
   transport passed it on (`--enable-test-endpoint-selection`), by the conformance tests'
   `test-epp-endpoint-selection` header; none left -> 503. The header's 503 says only that no
   endpoint is eligible, never which of the addresses it named is or is not in the pool.
4. Admission (saturation: sheddable requests get 429 while the pool is saturated).
5. Hash the prompt into prefix blocks and its affinity hint, if any (`prompt_cache_key`, else the
   session header: extproc/control/affinity.py), and, with KV events on, tokenize it
   (extproc/tokenization/) into token-block keys for the precise index; then run the scheduler.
6. Count the request in flight on the chosen endpoint (and, disaggregated, on its prefill
   endpoint: extproc/scheduling/disagg.py) until `complete()`; if the proxy reports
   (x-gateway-destination-endpoint-served) that a fallback served it, `served_by` moves the
   count and the prefix-index record to that endpoint.

In precise mode the processor awaits `prepare(ctx, body)` once the body is complete and before
`route`: it parses the body and tokenizes it off the event loop (local tokenizers in a worker
thread, extproc/tokenization/; the remote one over HTTP), so a 7,200-token prompt never stalls other
streams. A chunked local tokenizer stops at the first block no endpoint holds (the tokens after
it cannot change the lookup: extproc/kvevents/lookahead.py); the decision then estimates the
prompt's length, and the rest is tokenized after the answer, its keys recorded as speculative
entries of the chosen endpoint. `route` tokenizes in line only when `prepare` was not called
(in-process callers). `track_usage(ctx, decision)`
starts the closed loop for the response (extproc/control/usage.py) when `feedback` is set and the
usage sampler (`--usage-sample-rate`) picks the request; `watch_response` adds, for `/v1/responses`,
the response id that the next turn's `previous_response_id` names (extproc/control/response_ids.py).
Only for these does the processor ask the proxy for the response body.

Bodiless requests (GET /v1/models) skip 1, 4 and 5: a random candidate is chosen.

Flow control (`flow`, when the EndpointPickerConfig's feature gate turns it on): the processor
awaits `hold(ctx, size, dispatch)` once the body is complete; it resolves the request's flow (its
fairness id and its objective's priority) and waits in extproc/flowcontrol/ until `dispatch`
(which calls `route`) may run. Admission (4.) is then flow control's, not the 429 of saturation.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from extproc.config.settings import EppConfig
from extproc.control.affinity import affinity_hint, response_key
from extproc.control.health import Rotation
from extproc.control.response_ids import ResponseWatch
from extproc.control.usage import Prediction, Report, UsageSampler, UsageTracker, matched_bytes
from extproc.core.datastore import Datastore, Endpoint, split_host_port
from extproc.core.errors import EppError, ErrorCode
from extproc.flowcontrol.controller import FlowController, flow_request
from extproc.kvevents.lookahead import HeldPrefix
from extproc.prefix.hashing import affinity_hash, block_hashes
from extproc.request.openai import Api, ParsedRequest, api_from_path, parse_request
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.scheduler import Decision, Scheduler
from extproc.tokenization.factory import Tokenizer

Admission = Callable[[SchedulingRequest, Sequence[Endpoint]], None]
T = TypeVar("T")
log = logging.getLogger("prefix_epp.director")
# Prompts at most being keyed after their answers, and their prompt bytes in all: each holds its
# parsed body for the few milliseconds that takes. Beyond, a prompt keeps the speculative keys up
# to where its tokenizing stopped (a request right behind with the same prompt still matches
# them, and the engine's events bring the rest).
MAX_KEYING = 16
MAX_KEYING_BYTES = 16 * 1024 * 1024


class PreciseKeys(Protocol):
    """What the director needs of the precise index (extproc/kvevents/manager.py implements it):
    the engine's block size, how many prompt tokens a lookup can use, a prompt's block keys (at
    once, or while it is tokenized), and speculative records of keys made after the decision."""

    block_size: int

    @property
    def max_tokens(self) -> int: ...

    def keys_for(self, model: str, cache_salt: str, tokens: Sequence[int]) -> list[int] | None: ...

    def lookahead(self, model: str, cache_salt: str) -> HeldPrefix | None: ...

    def record_later(self, endpoint: str, keys: Sequence[int], /) -> bool: ...

    def flush(self) -> None: ...


@dataclass(slots=True)
class RequestContext:
    path: str = "/"
    method: str = "POST"
    request_id: str = ""
    objective: str = ""
    test_selection: str = ""
    subset: list[str] | None = None
    parsed: ParsedRequest | None = None
    tokens: list[int] | None = None  # from an asynchronous tokenizer (prepare)
    lookahead: HeldPrefix | None = None  # prepare's keys, where tokenizing may stop early
    session: str = ""  # the session header's value (affinity hint): only ever hashed
    affinity_source: str = ""  # set by route: where the request's affinity hint came from, if any
    sampled: bool | None = None  # the usage sampler's answer for this request (None: not asked yet)
    explain: bool = False  # the decision is explained in a response header (--explain-decisions)
    fairness_id: str = ""  # flow control: x-llm-d-inference-fairness-id (or its x-gateway- alias)
    request_ttl: str = ""  # flow control: x-llm-d-inference-ttl, as sent
    queued_ms: int | None = None  # flow control: milliseconds held before dispatch (None: not under it)


def _matches(ep: Endpoint, wanted: set[str]) -> bool:
    return ep.key in wanted or ep.address in wanted


def _parse_endpoint_list(values: Sequence[str]) -> set[str]:
    """Entries may be `ip`, `ip:port` or `[ipv6]:port`, possibly comma-separated."""
    wanted: set[str] = set()
    for value in values:
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            wanted.add(item)
            try:
                host, port = split_host_port(item)
            except ValueError:
                continue
            wanted.add(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return wanted


class Director:
    def __init__(
        self,
        config: EppConfig,
        datastore: Datastore,
        scheduler: Scheduler,
        admission: Admission | None = None,
        priority_of: Callable[[str], int] | None = None,
        rng: random.Random | None = None,
        precise: PreciseKeys | None = None,
        tokenizer: Tokenizer | None = None,
        routes_on_tokens: bool = True,
        rotation: Rotation | None = None,
    ) -> None:
        self.config = config
        self.datastore = datastore
        self.scheduler = scheduler
        self.rotation = rotation  # failing endpoints out of rotation (extproc/control/health.py)
        self.admission = admission
        self.priority_of = priority_of or (lambda _name: 0)
        self._rng = rng or random.Random()
        self.precise = precise
        self.tokenizer = tokenizer if precise is not None else None
        self.routes_on_tokens = routes_on_tokens  # False: --kv-events alone, the precise scorer only compared
        self.feedback: Report | None = None  # closed-loop reporter (EppMetrics.observe_usage)
        self.usage_sampler = UsageSampler(config.usage_sample_rate)
        self.finishing: set[asyncio.Task[None]] = set()  # prompts keyed after their answers
        self._keying_bytes = 0  # their prompt bytes
        self.flow: FlowController | None = None  # flow control, when its feature gate is on

    def candidates(self, ctx: RequestContext) -> list[Endpoint]:
        endpoints: list[Endpoint] = list(self.datastore.snapshot())
        if not endpoints:
            raise EppError(ErrorCode.SERVICE_UNAVAILABLE, "no ready endpoints in the pool")
        if ctx.subset is not None and not self.config.disable_endpoint_subset_filter:
            wanted = _parse_endpoint_list(ctx.subset)
            endpoints = [ep for ep in endpoints if _matches(ep, wanted)]
            if not endpoints:
                raise EppError(ErrorCode.SERVICE_UNAVAILABLE, "no eligible endpoint in the subset hint")
        if ctx.test_selection:
            wanted = _parse_endpoint_list([ctx.test_selection])
            endpoints = [ep for ep in endpoints if _matches(ep, wanted)]
            if not endpoints:
                raise EppError(ErrorCode.SERVICE_UNAVAILABLE, "no eligible endpoint for this request")
        if self.rotation is not None:
            endpoints = list(self.rotation.candidates(endpoints))
        if ctx.queued_ms is not None and self.flow is not None:  # under flow control: where there is room
            endpoints = self.flow.with_room(endpoints)
        return endpoints

    def new_request_id(self) -> str:
        return str(uuid.uuid4())

    def route(self, ctx: RequestContext, body: bytes) -> Decision:
        parsed = ctx.parsed if ctx.parsed is not None else parse_request(api_from_path(ctx.path), body)
        ctx.parsed = parsed
        candidates = self.candidates(ctx)
        pcfg = self.config.prefix
        request = SchedulingRequest(
            request_id=ctx.request_id,
            model=parsed.model,
            block_hashes=block_hashes(parsed.segments, parsed.model, parsed.cache_salt,
                                      block_size=pcfg.block_size_bytes, max_blocks=pcfg.max_prefix_blocks),
            priority=self.priority_of(ctx.objective) if ctx.objective else 0,
            prompt_bytes=sum(map(len, parsed.segments)),
            max_output_tokens=output_tokens(parsed.body),
        )
        request.affinity_hash, ctx.affinity_source = affinity_hint(
            self.config.affinity, parsed.model, parsed.cache_salt, parsed.affinity_key, ctx.session,
            parsed.previous_response_id)
        held = None
        if self.precise is not None and self.wants_tokens(ctx):
            request.token_keys = self._token_keys(ctx, parsed)
            tokens = len(ctx.tokens or ())
            held = ctx.lookahead if ctx.lookahead is not None and ctx.lookahead.stopped else None
            if held is not None and request.token_keys:
                tokens, request.token_blocks = held.estimated_tokens, held.blocks
            # Tokenization stops at the precise index's reach: a longer prompt is estimated from its bytes.
            request.prompt_tokens = tokens if tokens < self.precise.max_tokens else 0
        if self.admission is not None:
            self.admission(request, candidates)
        decision = self.scheduler.schedule(request, candidates)
        self.datastore.acquire(decision.primary.key)
        if decision.prefill is not None:  # its prefill's work, until the response ends
            self.datastore.acquire(decision.prefill.primary.key)
        if held is not None and request.token_keys and self.scheduler.precise is not None:
            self._finish_keys_later(parsed, held, decision.primary.key, request.prompt_bytes)
        return decision

    async def hold(self, ctx: RequestContext, size: int, dispatch: Callable[[], T]) -> T:
        """Flow control: wait for the request's turn in its flow (fairness id, objective priority),
        then return `dispatch()`, run at that turn; EppError when refused or evicted."""
        assert self.flow is not None
        priority = self.priority_of(ctx.objective) if ctx.objective else 0
        request = flow_request(ctx.fairness_id, ctx.request_ttl, priority, size, self.flow.config.max_header_chars)
        ctx.queued_ms = 0  # under flow control from here: dispatch schedules among endpoints with room
        result, waited = await self.flow.submit(request, dispatch)
        ctx.queued_ms = round(waited * 1000)
        return result

    def route_bodiless(self, ctx: RequestContext) -> Endpoint:
        candidates = self.candidates(ctx)
        ep = candidates[self._rng.randrange(len(candidates))]
        self.datastore.acquire(ep.key)
        return ep

    def complete(self, ep: Endpoint, decision: Decision | None = None, ok: bool | None = None) -> None:
        """The request on `ep` ended: release its in-flight count; the scheduler's observers learn
        that its prefill is over (a response came back, or the stream ended). `ok`: the response
        succeeded (True), failed (False: a 5xx, a reset, a failed connection; it counts towards
        the endpoint's ejection and teaches the scheduler nothing), or is unknown (None: the
        stream ended before a response, e.g. the client went away)."""
        self.datastore.release(ep)
        if decision is not None and decision.prefill is not None:
            self.datastore.release(decision.prefill.primary)
        if ok is not None and self.rotation is not None:
            self.rotation.outcome(ep, ok)
        if decision is not None:
            self.scheduler.finished(decision, ep, ok=ok is not False)

    def served_by(self, decision: Decision, current: Endpoint, served: str) -> Endpoint:
        """The proxy reports that `served` (ip:port) answered the request. If that is another
        endpoint of the decision's list, move the in-flight count and the prefix-index record
        there and return it; otherwise (unknown, not ours to move to, or the same) keep `current`.
        Only endpoints we returned are accepted, so a forged report cannot shift load elsewhere."""
        wanted = _parse_endpoint_list([served])
        target = next((ep for ep in decision.endpoints if _matches(ep, wanted)), None)
        if target is None or target.key == current.key:
            return current
        moved = self.datastore.acquire(target.key)
        if moved is None:  # left the pool meanwhile
            return current
        if self.rotation is not None and current is decision.primary:
            self.rotation.outcome(current, False)  # the proxy retried elsewhere: the first choice failed
        self.datastore.release(current)
        self.scheduler.reassign(decision, moved)
        return moved

    # -- precise prefix routing and the closed loop --------------------------------------------
    @property
    def tokenizes_async(self) -> bool:
        """True when routing may need `prepare` first: with KV events, tokens come off the event loop."""
        return self.tokenizer is not None

    def wants_tokens(self, ctx: RequestContext) -> bool:
        """Tokenize this request? Always when the scheduler routes on the precise index. With
        --kv-events alone the approximate scorer routes and the precise one is only compared, so
        only the requests whose predictions are compared (the usage sample, `ctx.sampled`) or
        explained pay for tokenizing, not every request on its way to the engine; one not asked
        yet (`sampled` None: an in-process caller) is tokenized. The precise index then holds the
        engines' events and the sampled requests' speculative records, not every routed one."""
        return self.tokenizer is not None and (self.routes_on_tokens or ctx.sampled is not False or ctx.explain)

    async def prepare(self, ctx: RequestContext, body: bytes) -> None:
        """Parse, then tokenize off the event loop (a worker thread, or the engine's /tokenize).

        Errors surface later in `route`.
        """
        if self.tokenizer is None or not self.wants_tokens(ctx):  # the first test narrows the type
            return
        try:
            ctx.parsed = parse_request(api_from_path(ctx.path), body)
        except EppError:
            return
        max_tokens, more = 0, None
        if self.precise is not None:
            max_tokens = self.precise.max_tokens
            more = ctx.lookahead = self.precise.lookahead(ctx.parsed.model, ctx.parsed.cache_salt)
        ctx.tokens = await self.tokenizer.encode_async(ctx.parsed, max_tokens, more)

    def _token_keys(self, ctx: RequestContext, parsed: ParsedRequest) -> list[int] | None:
        assert self.precise is not None
        tokens = ctx.tokens
        if tokens is None and self.tokenizer is not None and not self.tokenizer.is_async:
            tokens = ctx.tokens = self.tokenizer.encode(parsed, self.precise.max_tokens)
        if not tokens:
            return None
        if ctx.lookahead is not None:  # keyed while tokenizing: only the blocks after are keyed here
            try:
                return list(ctx.lookahead.keys(tokens))
            except ValueError:
                return None
        return self.precise.keys_for(parsed.model, parsed.cache_salt, tokens)

    def _finish_keys_later(self, parsed: ParsedRequest, held: HeldPrefix, endpoint: str, size: int) -> None:
        """Tokenizing stopped at the first block no endpoint held (extproc/kvevents/lookahead.py):
        tokenize the rest after the answer and make its keys speculative entries of `endpoint`,
        as the whole prompt's would have been at the decision. `size`: the prompt's bytes."""
        if len(self.finishing) >= MAX_KEYING or self._keying_bytes + size > MAX_KEYING_BYTES:
            return  # overloaded: the keys up to the stop stand, the engine's events bring the rest
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop, no prepare: nothing stopped early
            return
        task = loop.create_task(self._finish_keys(parsed, held, endpoint))
        self.finishing.add(task)
        self._keying_bytes += size

        def done(t: asyncio.Task[None]) -> None:
            self.finishing.discard(t)
            self._keying_bytes -= size

        task.add_done_callback(done)

    async def _finish_keys(self, parsed: ParsedRequest, held: HeldPrefix, endpoint: str) -> None:
        assert self.tokenizer is not None and self.precise is not None
        try:
            tokens = await self.tokenizer.encode_async(parsed, self.precise.max_tokens)
            rest = held.chain.extend(tokens) if tokens else []
        except Exception as exc:  # a background step: the decision stands, only the record is lost
            log.debug("keying the rest of a prompt failed", extra={"error": type(exc).__name__})
            return
        if rest and self.datastore.get(endpoint) is not None:  # not for an endpoint that left meanwhile
            self.precise.record_later(endpoint, rest)
            self.precise.flush()

    async def close(self) -> None:
        """Cancel the prompts still being keyed after their answers (shutdown)."""
        for task in list(self.finishing):
            task.cancel()
        await asyncio.gather(*self.finishing, return_exceptions=True)

    def learns_response_id(self, ctx: RequestContext) -> bool:
        """True for a `/v1/responses` request while affinity hints are on: its response's id is read
        (extproc/control/response_ids.py), so the proxy must send the response body."""
        return (self.config.affinity.enabled and self.scheduler.index is not None
                and api_from_path(ctx.path) is Api.RESPONSES)

    def watch_response(self, ctx: RequestContext, decision: Decision, *, sampled: bool | None = None,
                       ) -> ResponseWatch | None:
        """What to read of this response: the usage sample (`track_usage`) and, for `/v1/responses`,
        its id, which is recorded on the endpoint that served it; None when nothing is read."""
        usage = self.track_usage(ctx, decision, sampled=sampled)
        learn = None
        if ctx.parsed is not None and self.learns_response_id(ctx):
            model, salt, index = ctx.parsed.model, ctx.parsed.cache_salt, self.scheduler.index
            assert index is not None

            def learn(endpoint: str, response_id: str) -> None:
                index.record(endpoint, (affinity_hash(model, salt, response_key(response_id)),))
        if usage is None and learn is None:
            return None
        return ResponseWatch(decision.primary.key, usage, learn)

    def track_usage(self, ctx: RequestContext, decision: Decision, *, sampled: bool | None = None,
                    ) -> UsageTracker | None:
        """Closed loop for this response, when sampled: the engine's cached_tokens vs the predictions.

        None (the response body is not wanted) unless the request is sampled: `sampled` when the
        caller already asked the usage sampler (the processor does, at request headers), else the
        sampler is asked here.
        """
        if sampled is None:
            sampled = self.usage_sampler.take()
        if self.feedback is None or ctx.parsed is None or not sampled:
            return None
        segments = [len(s) for s in ctx.parsed.segments]
        ep = decision.primary
        block_size = ep.metrics.block_size if ep.metrics is not None and ep.metrics.block_size > 0 else (
            self.precise.block_size if self.precise is not None else self.config.kv_events.block_size)
        prediction = Prediction(
            block_size=block_size,
            approx_matched_bytes=matched_bytes(segments, self.config.prefix.block_size_bytes,
                                               decision.matched_blocks),
            prompt_bytes=sum(segments),
            precise_blocks=decision.precise_matched if decision.precise_usable else None,
            precise_enabled=self.precise is not None,
        )
        return UsageTracker(prediction, self.feedback)


MAX_OUTPUT_TOKENS = 1 << 20  # a larger max_tokens reads as unknown (no engine generates that much)


def output_tokens(body: dict[str, Any]) -> int:
    """The body's max_tokens (or max_completion_tokens): an integer in [1, MAX_OUTPUT_TOKENS], else 0."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_OUTPUT_TOKENS:
            return value
    return 0
