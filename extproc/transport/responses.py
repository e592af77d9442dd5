"""Builders for the ProcessingResponse messages the picker sends (protobuf upb classes).

Every routed request gets the destination in two places with the same value, as the endpoint
picker protocol requires: the `x-gateway-destination-endpoint` request header and the dynamic
metadata `envoy.lb / x-gateway-destination-endpoint`. Envoy should route on the metadata (see
`prefix-epp envoy-config`), which a client cannot forge.
"""

from __future__ import annotations

from extproc.core.errors import CONTENT_TYPE, EppError
from extproc.pb import envoy_core_pb2 as core
from extproc.pb import envoy_processing_mode_pb2 as mode_pb
from extproc.pb import external_processor_pb2 as pb

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_HEADER = "x-gateway-destination-endpoint-subset"
SERVED_HEADER = "x-gateway-destination-endpoint-served"
# llm-d's P/D header: the prefill endpoint the decode pod's sidecar sends the prefill to (set only
# when the decision disaggregates; a client's own copy never reaches the upstream).
PREFILLER_HEADER = "x-prefiller-host-port"
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"  # why flow control refused the request
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# Envoy's chunk limit for streamed body mutations is 64 KiB; the Go EPP uses 62000 bytes.
BODY_CHUNK_BYTES = 62000

_OVERWRITE = core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# Client-supplied routing headers never reach the upstream as sent.
_REMOVED_REQUEST_HEADERS = (SUBSET_HEADER, SERVED_HEADER)


def _set_header(mutation: pb.HeaderMutation, key: str, value: str) -> None:
    opt = mutation.set_headers.add()
    opt.header.key = key
    opt.header.raw_value = value.encode()
    opt.append_action = _OVERWRITE


def routed_headers(
    destination: str, content_length: int | None, request_id: str | None, *, buffered: bool,
    prefiller: str | None = None,
) -> pb.ProcessingResponse:
    """The reply that routes the request: header mutation + envoy.lb metadata + clear_route_cache.

    In FULL_DUPLEX_STREAMED mode it answers request_headers; in BUFFERED mode (headers already
    answered) it answers request_body, whose header mutation Envoy still applies. `prefiller`: the
    prefill endpoint of a disaggregated request, set as x-prefiller-host-port (overwriting a
    client's copy); without it the header is removed.
    """
    resp = pb.ProcessingResponse()
    common = resp.request_body.response if buffered else resp.request_headers.response
    common.clear_route_cache = True
    mutation = common.header_mutation
    _set_header(mutation, DESTINATION_HEADER, destination)
    if content_length is not None:
        _set_header(mutation, "content-length", str(content_length))
    if request_id is not None:
        _set_header(mutation, "x-request-id", request_id)
    mutation.remove_headers.extend(_REMOVED_REQUEST_HEADERS)
    # Set or removed, never both: the reply does not depend on the order Envoy applies them in.
    if prefiller is not None:
        _set_header(mutation, PREFILLER_HEADER, prefiller)
    else:
        mutation.remove_headers.append(PREFILLER_HEADER)
    lb = resp.dynamic_metadata.fields[LB_NAMESPACE].struct_value
    lb.fields[DESTINATION_HEADER].string_value = destination
    return resp


def body_chunks(body: bytes, *, request: bool, end_of_stream: bool = True) -> list[pb.ProcessingResponse]:
    """Stream `body` back to Envoy in FULL_DUPLEX_STREAMED chunks of at most BODY_CHUNK_BYTES."""
    out: list[pb.ProcessingResponse] = []
    n = len(body)
    view = memoryview(body)
    start = 0
    while True:
        end = min(start + BODY_CHUNK_BYTES, n)
        resp = pb.ProcessingResponse()
        part = resp.request_body if request else resp.response_body
        streamed = part.response.body_mutation.streamed_response
        streamed.body = bytes(view[start:end]) if (start or end != n) else body
        streamed.end_of_stream = end_of_stream and end == n
        out.append(resp)
        start = end
        if start >= n:
            return out


def echo_request_body(chunks: list[bytes], out: list[pb.ProcessingResponse]) -> None:
    """Stream the request body back as received (FULL_DUPLEX_STREAMED), splitting oversized chunks.

    Reusing the received chunks avoids one more copy of the whole body; the last message carries
    end_of_stream (an empty one for an empty body).
    """
    if not chunks:
        resp = pb.ProcessingResponse()
        resp.request_body.response.body_mutation.streamed_response.end_of_stream = True
        out.append(resp)
        return
    last = len(chunks) - 1
    for i, chunk in enumerate(chunks):
        if len(chunk) > BODY_CHUNK_BYTES:
            out.extend(body_chunks(chunk, request=True, end_of_stream=i == last))
            continue
        resp = pb.ProcessingResponse()
        streamed = resp.request_body.response.body_mutation.streamed_response
        streamed.body = chunk
        streamed.end_of_stream = i == last
        out.append(resp)


_MODE = mode_pb.ProcessingMode


def override_response_mode(resp: pb.ProcessingResponse, request_body_mode: int, *, headers: bool,
                           body: bool) -> None:
    """Set, for this request only, what of the response Envoy sends the picker.

    Response headers only when wanted (the decision explanation), the body (STREAMED) only for
    the usage sample, and trailers always: Envoy then keeps the ext_proc stream open until the
    response is complete, which is when the picker releases the request's in-flight count. The
    request side keeps the static request body mode (the body is still to come).
    """
    override = resp.mode_override
    override.request_header_mode = _MODE.SEND
    override.request_body_mode = request_body_mode  # type: ignore[assignment]
    override.request_trailer_mode = _MODE.SKIP
    override.response_header_mode = _MODE.SEND if headers else _MODE.SKIP
    override.response_body_mode = _MODE.STREAMED if body else _MODE.NONE
    override.response_trailer_mode = _MODE.SEND


def empty_request_headers() -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse()
    resp.request_headers.SetInParent()
    return resp


def empty_request_body() -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse()
    resp.request_body.SetInParent()
    return resp


def response_headers(extra: tuple[tuple[str, str], ...] = ()) -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse()
    common = resp.response_headers.response
    common.SetInParent()
    for key, value in extra:
        _set_header(common.header_mutation, key, value)
    return resp


def empty_response_body() -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse()
    resp.response_body.SetInParent()
    return resp


def empty_trailers(request: bool) -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse()
    (resp.request_trailers if request else resp.response_trailers).SetInParent()
    return resp


def immediate_error(err: EppError, request_id: str = "") -> pb.ProcessingResponse:
    """ImmediateResponse with the status, the JSON error body (extproc/core/errors.py) and its content type."""
    resp = pb.ProcessingResponse()
    imm = resp.immediate_response
    imm.status.code = err.http_status  # type: ignore[assignment]
    imm.body = err.body()
    imm.details = f"prefix_epp_{err.code.value}"
    _set_header(imm.headers, "content-type", CONTENT_TYPE)
    if err.retry_after_s is not None:
        _set_header(imm.headers, "retry-after", str(err.retry_after_s))
    if err.dropped_reason:
        _set_header(imm.headers, DROPPED_REASON_HEADER, err.dropped_reason)
    if request_id:
        _set_header(imm.headers, "x-request-id", request_id)
    return resp
