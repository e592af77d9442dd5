"""The ext_proc stream state machine: one `StreamProcessor` per HTTP request.

Message sequence, FULL_DUPLEX_STREAMED request body (the Inference Extension's mode):

    Envoy -> request_headers            (we answer nothing yet)
    Envoy -> request_body x N           (buffered until end_of_stream, or request_trailers)
    picker -> request_headers response  (destination header + envoy.lb metadata + clear_route_cache;
                                        x-prefiller-host-port set when disaggregated, else removed)
    picker -> request_body x M          (the received chunks streamed back, <= 62000 bytes each, last EoS)
    picker -> request_trailers response (only if Envoy sent request_trailers)

BUFFERED request body: request_headers is answered at once (empty); the single request_body
message is answered with the destination header mutation and metadata; the body is left as is.

A request without a body (request_headers.end_of_stream) is routed at once in the headers reply.

Response path. The default wiring (`prefix-epp envoy-config`: BUFFERED request bodies, response
trailers SEND, response headers SKIP, response body NONE) keeps the picker off the token stream:
its cost per request does not depend on the length of the answer.

    picker -> request_headers response  (+ mode_override: what of this response to send)
    Envoy -> response_headers           picker -> + explanation header (with --explain-decisions); its
                                        :status is the request's outcome (metrics, ejection:
                                        extproc/control/health.py), and a served endpoint other
                                        than the first choice moves the accounting there
    [Envoy -> response_body x K         picker -> an empty reply each (STREAMED, sampled requests only)]
    Envoy -> response_trailers          picker -> empty trailers response (only if the upstream sent some)
    stream end                          (Envoy closes the stream when the response is complete)

The per-request `mode_override` in the request_headers reply (BUFFERED requests, and bodiless
ones routed there) sets response trailers SEND, so Envoy keeps the ext_proc stream open until the
response is complete even where the gateway statically skips trailers (Envoy Gateway); response
headers SEND (one message per request: the outcome); the response body
in STREAMED mode only for the requests the usage sampler picks (the closed loop,
extproc/control/usage.py) and for `/v1/responses` (its id: extproc/control/response_ids.py).
Completion (in-flight release) is the response's end: a response body's end_of_stream, the
response trailers, or else the end of the gRPC stream. Envoy ignores `mode_override` in any
other reply and whenever its static request or response body mode is FULL_DUPLEX_STREAMED
(ext_proc.cc, onReceiveMessage); then the static mode rules: with
FULL_DUPLEX_STREAMED response bodies (the reference configuration) every chunk is echoed back and
only sampled requests feed the usage parser (and `/v1/responses` the id reader).

With flow control on (extproc/flowcontrol/) the complete body then waits in `Director.hold` for
its turn (`_hold`), and is routed at that turn; the stream's end cancels the wait.
With KV events (a tokenizer) the complete body is first handed to `Director.prepare`, awaited,
before routing, so tokenization never runs on the event loop; with --kv-events alone only for the
requests the usage sampler picks (`Director.wants_tokens`).
Errors end the exchange with an ImmediateResponse whose body is OpenAI-style JSON
(extproc/core/errors.py). `run` guards the whole exchange: any unexpected exception becomes a 500 with
the request id, counted in the error metrics and logged once with its traceback (never the
prompt), so every stream ends with an answer Envoy can forward. In-flight accounting is released
when the response ends, and in any case when the stream ends (client gone, Envoy reset, error).
Ordering rule: nothing for the request body or trailers is sent before the headers reply.

Refused at the first message (500 naming the mode, one log line per mode): request body modes
other than FULL_DUPLEX_STREAMED and BUFFERED. STREAMED and BUFFERED_PARTIAL forward the headers
before the body is complete, so the picker could not route on the prompt; NONE never sends the
body at all (a bodiless request is still routed in every mode).
Body intake (extproc/transport/body_intake.py): received bytes, never declared ones, are charged
to the shared budget; the body must end within `--request-body-timeout` of the headers (408).
Once routed, a stream keeps its request id, endpoint, decision and model name, nothing of the
body (parsed tree, tokens, chunks and messages are dropped): a long generation holds KiBs.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING

from extproc.control.affinity import header_to_read
from extproc.control.director import Director, RequestContext
from extproc.core.datastore import Endpoint
from extproc.core.errors import EppError, ErrorCode
from extproc.pb import envoy_processing_mode_pb2 as mode_pb
from extproc.pb import external_processor_pb2 as pb
from extproc.telemetry.epp import EppMetrics
from extproc.transport import responses as R
from extproc.transport.body_budget import BodyBudget
from extproc.transport.body_intake import BodyIntake
from extproc.transport.control_headers import read_control_headers
from extproc.transport.lb_metadata import response_status, served_endpoint, subset_hint
from extproc.transport.stream_end import StreamEnd

if TYPE_CHECKING:
    from extproc.control.response_ids import ResponseWatch
    from extproc.scheduling.scheduler import Decision

log = logging.getLogger("prefix_epp.extproc")

_BUFFERED = mode_pb.ProcessingMode.BUFFERED
_FULL_DUPLEX = mode_pb.ProcessingMode.FULL_DUPLEX_STREAMED
_NONE = mode_pb.ProcessingMode.NONE
EXPLAIN_HEADER = "x-prefix-epp-decision"
QUEUE_DURATION_HEADER = "x-llm-d-flow-queue-duration-ms"
_SUPPORTED_BODY_MODES = frozenset({_BUFFERED, _FULL_DUPLEX})
_MAX_ECHOED_ID = 256  # a longer client x-request-id is not echoed in error replies
_refused_modes_logged: set[int] = set()


class StreamProcessor:
    __slots__ = ("_director", "_endpoint", "_headers_seen", "_intake", "_metrics", "_model",
                 "_new_request_id", "_request_mode", "_response_mode", "_session_header", "_status",
                 "_test_selection", "_usage", "ctx", "decision", "stream_end")

    def __init__(self, director: Director, metrics: EppMetrics, explain: bool,
                 budget: BodyBudget | None = None) -> None:
        cfg = director.config
        self._director = director
        self._intake = BodyIntake(budget, cfg.max_request_body_bytes, cfg.request_body_timeout_s)
        self._headers_seen = False
        self._metrics = metrics
        self.ctx = RequestContext(explain=explain)
        self._model = ""  # the routed request's model, kept for the metrics once ctx.parsed is dropped
        self._new_request_id: str | None = None
        self._endpoint: Endpoint | None = None
        self.decision: Decision | None = None
        self._request_mode = _FULL_DUPLEX
        self._response_mode = _NONE
        self._usage: ResponseWatch | None = None
        self._status = 0  # the response's HTTP status, once its headers came (0: none yet)
        self._session_header = header_to_read(cfg.affinity)  # "": no header name is empty
        self._test_selection = cfg.test_endpoint_selection
        self.stream_end = StreamEnd()  # how the stream ended, for its metric (extproc/transport/stream_end.py)

    async def run(self, requests: AsyncIterator[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingResponse]:
        """The exchange, guarded: an unexpected exception ends the stream with a 500, never a gRPC error."""
        inner = self._exchange(requests)
        try:
            async for resp in inner:
                yield resp
                del resp  # not kept while the next message is awaited (an echoed chunk: up to 62000 bytes)
        except Exception as exc:
            yield self._internal_error(exc)
        finally:
            await inner.aclose()

    async def _exchange(
        self, requests: AsyncIterator[pb.ProcessingRequest]
    ) -> AsyncGenerator[pb.ProcessingResponse, None]:
        """One message at a time; a message lives only while `_handle` runs, a reply until it is sent."""
        stream = aiter(requests)
        try:
            while True:
                try:
                    msg = await self._intake.next_message(stream)
                except StopAsyncIteration:
                    return
                if msg is None:  # the body's deadline passed
                    yield self._refuse_body(self._intake.timed_out())
                    return
                out = await self._handle(msg)
                self.stream_end.handled(msg)
                del msg
                out.reverse()  # popped from the end: each reply is dropped once it is sent
                while out:
                    resp = out.pop()
                    immediate = resp.HasField("immediate_response")
                    yield resp
                    del resp
                    if immediate:
                        return
        finally:
            self._intake.release()
            self._complete()

    async def _handle(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if msg.HasField("protocol_config"):
            self._configure(msg.protocol_config)
        kind = msg.WhichOneof("request")
        self._metrics.count_message(kind)
        if kind == "request_headers":
            return self.on_request_headers(msg)
        if kind == "request_body":
            body = msg.request_body
            intake = self._intake
            if body.end_of_stream and not intake.done and self._director.tokenizes_async:
                ctx = self.ctx
                if ctx.sampled is None:
                    # Full-duplex responses: the sampler is asked here, not after routing, as tokenizing
                    # depends on it. Other modes settled it at the headers or never read the response.
                    ctx.sampled = self._director.usage_sampler.take() if self._response_mode == _FULL_DUPLEX else False
                last = body.body
                if intake.fits(last) and self._director.wants_tokens(ctx):
                    await self._director.prepare(ctx, intake.peek(last))
                del last
            if body.end_of_stream and self._holds():
                return await self._hold(len(body.body), lambda: self.on_request_body(body))
            return self.on_request_body(body)
        if kind == "request_trailers":
            if self._holds():
                return await self._hold(0, self.on_request_trailers)
            return self.on_request_trailers()
        if kind == "response_headers":
            return self.on_response_headers(msg.response_headers, msg)
        if kind == "response_body":
            return self.on_response_body(msg.response_body)
        if kind == "response_trailers":
            return self.on_response_trailers()
        return []

    def _configure(self, cfg: pb.ProtocolConfiguration) -> None:
        """Envoy sends its processing modes once, with the first message of the stream."""
        self._request_mode = cfg.request_body_mode
        self._response_mode = cfg.response_body_mode
        self.stream_end.reads_response = cfg.response_body_mode != _NONE

    # -- request path ------------------------------------------------------------------------
    def on_request_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self._headers_seen:  # one request per stream: a repeated headers message changes nothing
            return []
        self._headers_seen = True
        ctx = self.ctx
        intake = self._intake
        read = read_control_headers(msg.request_headers.headers, ctx, self._session_header, self._test_selection)
        if read.ignored:
            self._metrics.ignored_header(read.ignored)
        ctx.subset = subset_hint(msg)
        if not ctx.request_id:
            ctx.request_id = self._new_request_id = self._director.new_request_id()
        if read.bad:
            intake.release()
            return [self._error(EppError(ErrorCode.BAD_REQUEST, f"header {read.bad} is not valid UTF-8"))]
        if msg.request_headers.end_of_stream:
            resp = self._route_bodiless()
        elif self._request_mode not in _SUPPORTED_BODY_MODES:
            return [self._refuse_mode()]
        else:
            declared = read.declared
            if declared.isascii() and declared.isdigit():
                refused = intake.admit_declared(int(declared))
                if refused is not None:
                    return [self._refuse_body(refused)]
            intake.start()
            if self._request_mode != _BUFFERED:
                return []  # FULL_DUPLEX_STREAMED: the headers reply waits for the decision
            resp = R.empty_request_headers()
        if self._response_mode != _FULL_DUPLEX and not resp.HasField("immediate_response"):
            # Envoy honours mode_override only in a headers reply and without full-duplex bodies.
            ctx.sampled = self._director.usage_sampler.take()
            # Response headers always: their status is the request's outcome (ejection, metrics),
            # and they say which of several endpoints served it.
            body = ctx.sampled or self._director.learns_response_id(ctx)  # usage sample, response id
            R.override_response_mode(resp, self._request_mode, headers=True, body=body)
            if self._request_mode == _BUFFERED:  # honoured: the response body comes, or not, as asked
                self.stream_end.reads_response = bool(body)
        return [resp]

    def _refuse_mode(self) -> pb.ProcessingResponse:
        self._intake.release()
        mode = self._request_mode
        name = mode_pb.ProcessingMode.BodySendMode.Name(mode) if 0 <= mode <= 4 else str(mode)
        if mode not in _refused_modes_logged:
            _refused_modes_logged.add(mode)
            log.error("unsupported ext_proc request_body_mode: configure FULL_DUPLEX_STREAMED or BUFFERED",
                      extra={"request_body_mode": name})
        return self._error(EppError(ErrorCode.INTERNAL, f"the endpoint picker does not support the ext_proc "
                                    f"request_body_mode {name}; use FULL_DUPLEX_STREAMED or BUFFERED"))

    def _refuse_body(self, err: EppError) -> pb.ProcessingResponse:
        self._intake.release()
        return self._error(err)

    def on_request_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self._intake.done:
            return []
        if self._request_mode not in _SUPPORTED_BODY_MODES:
            return [self._refuse_mode()]  # Envoy skipped the headers phase
        refused = self._intake.add(body.body)
        if refused is not None:
            return [self._refuse_body(refused)]
        if not body.end_of_stream:
            return []
        return self._route_body()

    def _holds(self) -> bool:
        """Whether the body just completed goes through flow control first."""
        return self._director.flow is not None and not self._intake.done and self._request_mode in _SUPPORTED_BODY_MODES

    async def _hold(self, last: int, route: Callable[[], list[pb.ProcessingResponse]]) -> list[pb.ProcessingResponse]:
        """Flow control (extproc/flowcontrol/): wait for the request's turn, then `route` it at that
        turn. A last chunk of `last` bytes stays in its message, one copy, charged to the body
        budget meanwhile. The stream's end (client gone) cancels the wait, which takes the request
        out of its queue."""
        intake = self._intake
        refused = intake.reserve_last(last)
        if refused is not None:
            return [self._refuse_body(refused)]
        try:
            return await self._director.hold(self.ctx, intake.received + last, route)
        except EppError as err:
            return [self._refuse_body(err)]

    def on_request_trailers(self) -> list[pb.ProcessingResponse]:
        out = [] if self._intake.done else self._route_body()
        if out and out[-1].HasField("immediate_response"):
            return out
        out.append(R.empty_trailers(request=True))
        return out

    def _route_body(self) -> list[pb.ProcessingResponse]:
        intake = self._intake
        chunks = intake.take()
        start = time.perf_counter()
        ctx = self.ctx
        try:
            # The joined copy lives only while the director parses it; the echo reuses the chunks.
            # prepare() may have parsed the body already; then it is not joined again.
            raw = b"" if ctx.parsed is not None or not chunks else chunks[0] if len(chunks) == 1 else b"".join(chunks)
            decision = self._director.route(ctx, raw)
            del raw
        except EppError as err:
            intake.release()
            resp = self._error(err)
            self._forget_body()
            return [resp]
        self._metrics.observe_decision(time.perf_counter() - start)
        self.decision = decision
        self._endpoint = decision.primary
        if ctx.sampled or self._response_mode == _FULL_DUPLEX or self._director.learns_response_id(ctx):
            self._usage = self._director.watch_response(ctx, decision, sampled=ctx.sampled)  # else no body comes
        if decision.total_blocks:
            self._metrics.observe_hit_ratio(decision.matched_blocks / decision.total_blocks)
        api = ctx.parsed.api.value if ctx.parsed is not None else ""
        self._forget_body()
        self._metrics.routed(self._model, self._model, api)
        if decision.affinity_hit is not None:
            self._metrics.affinity(ctx.affinity_source, decision.affinity_hit)
        if decision.pd:
            self._metrics.pd_decision(decision.pd)
        new_id = self._new_request_id
        if self._request_mode == _BUFFERED:
            intake.release()  # nothing to stream back: the body is no longer held
            return [R.routed_headers(decision.destination, None, new_id, buffered=True, prefiller=decision.prefiller)]
        out = [R.routed_headers(decision.destination, intake.received, new_id, buffered=False,
                                prefiller=decision.prefiller)]
        R.echo_request_body(chunks, out)
        # The body now lives on in the chunk replies only until they are written.
        intake.release()
        return out

    def _forget_body(self) -> None:
        """The decision is made: keep the model's name, drop the parsed body and its tokens."""
        ctx = self.ctx
        if ctx.parsed is not None:
            self._model = ctx.parsed.model
        ctx.parsed = None
        ctx.tokens = None
        ctx.lookahead = None

    def _route_bodiless(self) -> pb.ProcessingResponse:
        self._intake.release()
        try:
            ep = self._director.route_bodiless(self.ctx)
        except EppError as err:
            return self._error(err)
        self._endpoint = ep
        self._metrics.routed("", "", "bodiless")
        return R.routed_headers(ep.key, None, self._new_request_id, buffered=False)

    def _error(self, err: EppError) -> pb.ProcessingResponse:
        self.stream_end.refused()
        parsed = self.ctx.parsed
        model = parsed.model if parsed is not None else self._model
        self._metrics.error(model, model, err.code.value, err.http_status)
        log.info("request rejected", extra={"request_id": self.ctx.request_id, "code": err.code.value,
                                             "status": err.http_status, "reason": err.message})
        rid = self.ctx.request_id
        return R.immediate_error(err, rid if len(rid) <= _MAX_ECHOED_ID else "")

    def _internal_error(self, exc: Exception) -> pb.ProcessingResponse:
        """A fault of the picker itself: one log line with the traceback, without the exception's
        message (it may quote the prompt), and a 500 that names the request id."""
        self._intake.release()
        self._complete()
        self.stream_end.failed = True
        rid = self.ctx.request_id or self._director.new_request_id()
        self.ctx.request_id = rid
        log.error("internal error", extra={"request_id": rid, "exception": type(exc).__name__,
                                           "traceback": "".join(traceback.format_tb(exc.__traceback__))})
        err = EppError(ErrorCode.INTERNAL, f"internal error in the endpoint picker (request id {rid})")
        try:
            return self._error(err)
        except Exception:  # the metrics or the logging failed too: still answer
            return R.immediate_error(err)

    # -- response path -----------------------------------------------------------------------
    def on_response_headers(self, headers: pb.HttpHeaders,
                            msg: pb.ProcessingRequest | None = None) -> list[pb.ProcessingResponse]:
        decision, ep = self.decision, self._endpoint
        self._status = response_status(headers)
        if decision is not None and ep is not None and len(decision.endpoints) > 1:
            served = served_endpoint(msg, headers)
            if served:  # a fallback may have served it: move the accounting there
                self._endpoint = self._director.served_by(decision, ep, served)
                if self._usage is not None:
                    self._usage.endpoint = self._endpoint.key  # a response id is recorded there
        extra: tuple[tuple[str, str], ...] = ()
        if self.ctx.explain and self.decision is not None:
            extra = ((EXPLAIN_HEADER, self.decision.explain()),)
        elif self.ctx.explain and self._endpoint is not None:
            extra = ((EXPLAIN_HEADER, f"endpoint={self._endpoint.key}; bodiless"),)
        if self.ctx.queued_ms is not None:  # flow control held it (0: dispatched at once)
            extra = (*extra, (QUEUE_DURATION_HEADER, str(self.ctx.queued_ms)))
        if headers.end_of_stream:
            self._usage = None
            self._complete()
        return [R.response_headers(extra)]

    def on_response_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        usage = self._usage
        if self._response_mode == _FULL_DUPLEX:
            data = body.body  # one copy out of the message, shared by the parser and the echo
            if usage is not None:
                usage.feed(data)
            out = R.body_chunks(data, request=False, end_of_stream=body.end_of_stream)
        else:
            if usage is not None:
                usage.feed(body.body)
            out = [R.empty_response_body()]
        if body.end_of_stream:
            if usage is not None:
                self._usage = None
                usage.finish()
            self._complete()
        return out

    def on_response_trailers(self) -> list[pb.ProcessingResponse]:
        usage, self._usage = self._usage, None
        if usage is not None:
            usage.finish()
        self._complete()
        return [R.empty_trailers(request=False)]

    def _complete(self) -> None:
        """The request ended: release it, with its outcome (the status the client got; a 5xx is a
        failure of the endpoint that served it; no response at all, e.g. the client went away,
        is neither)."""
        ep = self._endpoint
        if ep is not None:
            self._endpoint = None
            status = self._status
            self._director.complete(ep, self.decision, None if status == 0 else status < 500)
            self._metrics.responded(status)
