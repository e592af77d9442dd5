"""The ext_proc stream state machine: one `StreamProcessor` per HTTP request.

Message sequence, FULL_DUPLEX_STREAMED request body (the Inference Extension's mode):

    Envoy -> request_headers            (we answer nothing yet)
    Envoy -> request_body x N           (buffered until end_of_stream, or request_trailers)
    picker -> request_headers response  (destination header + envoy.lb metadata + clear_route_cache)
    picker -> request_body x M          (the body streamed back, chunks <= 62000 bytes, last one EoS)
    picker -> request_trailers response (only if Envoy sent request_trailers)
    Envoy -> response_headers           picker -> response_headers (unchanged; + explanation header);
                                        a served endpoint other than the first choice moves the accounting
    Envoy -> response_body x K          picker -> each chunk straight back (duplex) or an empty reply
    Envoy -> response_trailers          picker -> empty trailers response

BUFFERED request body: request_headers is answered at once (empty); the single request_body
message is answered with the destination header mutation and metadata; the body is left as is.

A request without a body (request_headers.end_of_stream) is routed at once in the headers reply.
With an asynchronous tokenizer (`--tokenizer remote`) the complete body is first handed to
`Director.prepare`, awaited, before routing. Response body chunks also feed the closed loop's
usage tail (extproc/server/usage.py), which reports at the end of the response.
Errors end the exchange with an ImmediateResponse. In-flight accounting is released when the
response ends, and in any case when the stream ends (client gone, Envoy reset, error).
Ordering rule: nothing for the request body or trailers is sent before the headers reply.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from extproc.datastore import Endpoint
from extproc.director import Director, RequestContext
from extproc.errors import EppError, ErrorCode
from extproc.metrics.epp import EppMetrics
from extproc.pb import envoy_processing_mode_pb2 as mode_pb
from extproc.pb import external_processor_pb2 as pb
from extproc.server import responses as R

if TYPE_CHECKING:
    from extproc.scheduling.scheduler import Decision
    from extproc.server.usage import UsageTracker

log = logging.getLogger("prefix_epp.extproc")

_BUFFERED = mode_pb.ProcessingMode.BUFFERED
_FULL_DUPLEX = mode_pb.ProcessingMode.FULL_DUPLEX_STREAMED
_NONE = mode_pb.ProcessingMode.NONE
EXPLAIN_HEADER = "x-prefix-epp-decision"
_WANTED_HEADERS = frozenset({
    ":path", ":method", "x-request-id", "test-epp-endpoint-selection", "x-gateway-inference-objective",
})


class StreamProcessor:
    __slots__ = ("_body", "_body_bytes", "_body_done", "_director", "_endpoint", "_explain", "_metrics",
                 "_new_request_id", "_request_mode", "_response_mode", "_usage", "ctx", "decision")

    def __init__(self, director: Director, metrics: EppMetrics, explain: bool) -> None:
        self._director = director
        self._metrics = metrics
        self._explain = explain
        self.ctx = RequestContext()
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._body_done = False
        self._new_request_id: str | None = None
        self._endpoint: Endpoint | None = None
        self.decision: Decision | None = None
        self._request_mode = _FULL_DUPLEX
        self._response_mode = _NONE
        self._usage: UsageTracker | None = None

    async def run(self, requests: AsyncIterator[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingResponse]:
        try:
            async for msg in requests:
                kind = msg.WhichOneof("request")
                if kind == "request_headers":
                    out = self.on_request_headers(msg)
                elif kind == "request_body":
                    if msg.request_body.end_of_stream and not self._body_done and self._director.tokenizes_async:
                        await self._director.prepare(self.ctx, b"".join([*self._body, msg.request_body.body]))
                    out = self.on_request_body(msg.request_body)
                elif kind == "request_trailers":
                    out = self.on_request_trailers()
                elif kind == "response_headers":
                    out = self.on_response_headers(msg.response_headers, msg)
                elif kind == "response_body":
                    out = self.on_response_body(msg.response_body)
                elif kind == "response_trailers":
                    out = self.on_response_trailers()
                else:
                    continue
                for resp in out:
                    yield resp
                    if resp.HasField("immediate_response"):
                        return
        finally:
            self._complete()

    # -- request path ------------------------------------------------------------------------
    def on_request_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if msg.HasField("protocol_config"):
            self._request_mode = msg.protocol_config.request_body_mode or _FULL_DUPLEX
            self._response_mode = msg.protocol_config.response_body_mode
        ctx = self.ctx
        for h in msg.request_headers.headers.headers:
            if h.key in _WANTED_HEADERS:
                value = h.raw_value.decode() if h.raw_value else h.value
                if h.key == ":path":
                    ctx.path = value
                elif h.key == ":method":
                    ctx.method = value
                elif h.key == "x-request-id":
                    ctx.request_id = value
                elif h.key == "test-epp-endpoint-selection":
                    ctx.test_selection = value
                else:
                    ctx.objective = value
        ctx.subset = _subset_hint(msg)
        if not ctx.request_id:
            ctx.request_id = self._new_request_id = self._director.new_request_id()
        if msg.request_headers.end_of_stream:
            return [self._route_bodiless()]
        if self._request_mode == _BUFFERED or self._request_mode == mode_pb.ProcessingMode.STREAMED:
            return [R.empty_request_headers()]
        return []

    def on_request_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self._body_done:
            return []
        if body.body:
            self._body.append(body.body)
            self._body_bytes += len(body.body)
            limit = self._director.config.max_request_body_bytes
            if self._body_bytes > limit:
                self._body_done = True
                self._body = []
                return [self._error(EppError(ErrorCode.PAYLOAD_TOO_LARGE,
                                             f"request body exceeds {limit} bytes"))]
        if not body.end_of_stream:
            return [R.empty_request_body()] if self._request_mode == mode_pb.ProcessingMode.STREAMED else []
        return self._route_body()

    def on_request_trailers(self) -> list[pb.ProcessingResponse]:
        out = [] if self._body_done else self._route_body()
        if out and out[-1].HasField("immediate_response"):
            return out
        out.append(R.empty_trailers(request=True))
        return out

    def _route_body(self) -> list[pb.ProcessingResponse]:
        self._body_done = True
        raw = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        start = time.perf_counter()
        ctx = self.ctx
        try:
            decision = self._director.route(ctx, raw)
        except EppError as err:
            return [self._error(err)]
        self._metrics.observe_decision(time.perf_counter() - start)
        self.decision = decision
        self._endpoint = decision.primary
        self._usage = self._director.track_usage(ctx, decision)
        if decision.total_blocks:
            self._metrics.observe_hit_ratio(decision.matched_blocks / decision.total_blocks)
        model = ctx.parsed.model if ctx.parsed else ""
        self._metrics.routed(model, model)
        new_id = self._new_request_id
        if self._request_mode == _BUFFERED:
            return [R.routed_headers(decision.destination, None, new_id, buffered=True)]
        out = [R.routed_headers(decision.destination, len(raw), new_id, buffered=False)]
        out.extend(R.body_chunks(raw, request=True))
        return out

    def _route_bodiless(self) -> pb.ProcessingResponse:
        try:
            ep = self._director.route_bodiless(self.ctx)
        except EppError as err:
            return self._error(err)
        self._endpoint = ep
        self._body_done = True
        self._metrics.routed("", "")
        return R.routed_headers(ep.key, None, self._new_request_id, buffered=False)

    def _error(self, err: EppError) -> pb.ProcessingResponse:
        model = self.ctx.parsed.model if self.ctx.parsed else ""
        self._metrics.error(model, model, err.code.value, err.http_status)
        log.info("request rejected", extra={"request_id": self.ctx.request_id, "code": err.code.value,
                                             "status": err.http_status, "reason": err.message})
        return R.immediate_error(err)

    # -- response path -----------------------------------------------------------------------
    def on_response_headers(self, headers: pb.HttpHeaders,
                            msg: pb.ProcessingRequest | None = None) -> list[pb.ProcessingResponse]:
        decision, ep = self.decision, self._endpoint
        if decision is not None and ep is not None and len(decision.endpoints) > 1:
            served = _served_endpoint(msg, headers)
            if served:  # a fallback may have served it: move the accounting there
                self._endpoint = self._director.served_by(decision, ep, served)
        extra: tuple[tuple[str, str], ...] = ()
        if self._explain and self.decision is not None:
            extra = ((EXPLAIN_HEADER, self.decision.explain()),)
        elif self._explain and self._endpoint is not None:
            extra = ((EXPLAIN_HEADER, f"endpoint={self._endpoint.key}; bodiless"),)
        out = [R.response_headers(extra)]
        if headers.end_of_stream:
            self._complete()
        return out

    def on_response_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        usage = self._usage
        if usage is not None:
            usage.feed(body.body)
            if body.end_of_stream:
                self._usage = None
                usage.finish()
        if body.end_of_stream:
            self._complete()
        if self._response_mode == _FULL_DUPLEX:
            return R.body_chunks(body.body, request=False, end_of_stream=body.end_of_stream)
        return [R.empty_response_body()]

    def on_response_trailers(self) -> list[pb.ProcessingResponse]:
        usage, self._usage = self._usage, None
        if usage is not None:
            usage.finish()
        self._complete()
        return [R.empty_trailers(request=False)]

    def _complete(self) -> None:
        ep = self._endpoint
        if ep is not None:
            self._endpoint = None
            self._director.complete(ep)


def _served_endpoint(msg: pb.ProcessingRequest | None, headers: pb.HttpHeaders) -> str:
    """x-gateway-destination-endpoint-served: the envoy.lb metadata the protocol defines, else
    the response header of the same name (the proxy sets it; prefix-epp envoy-config does both)."""
    if msg is not None:
        fm = msg.metadata_context.filter_metadata
        if R.LB_NAMESPACE in fm:
            value = fm[R.LB_NAMESPACE].fields.get(R.SERVED_HEADER)
            if value is not None and value.string_value:
                return str(value.string_value)
    for h in headers.headers.headers:
        if h.key == R.SERVED_HEADER:
            return h.raw_value.decode(errors="replace") if h.raw_value else str(h.value)
    return ""


def _subset_hint(msg: pb.ProcessingRequest) -> list[str] | None:
    fm = msg.metadata_context.filter_metadata
    if R.SUBSET_NAMESPACE not in fm:
        return None
    fields = fm[R.SUBSET_NAMESPACE].fields
    if R.SUBSET_HEADER not in fields:
        return None
    value = fields[R.SUBSET_HEADER]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    if kind == "string_value":
        return [value.string_value]
    return []

