# mypy: disable-error-code="union-attr"
"""Our minimal ext_proc .proto must be wire-compatible with Envoy's canonical definitions.

For every message the picker uses: encode with our upb classes, decode with the canonical
betterproto classes of `envoy-data-plane` (generated from Envoy's own .proto files), and back.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from envoy_data_plane.envoy.config.core import v3 as canon_core
from envoy_data_plane.envoy.service.ext_proc import v3 as canon

from extproc.core.errors import EppError, ErrorCode
from extproc.pb import envoy_core_pb2 as core
from extproc.pb import envoy_processing_mode_pb2 as mode
from extproc.pb import external_processor_pb2 as pb
from extproc.transport import responses as R


def _request_headers() -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    hdrs = msg.request_headers.headers.headers
    for k, v in ((":path", "/v1/completions"), (":method", "POST"), ("x-request-id", "abc")):
        h = hdrs.add()
        h.key = k
        h.raw_value = v.encode()
    msg.request_headers.end_of_stream = False
    msg.protocol_config.request_body_mode = mode.ProcessingMode.FULL_DUPLEX_STREAMED
    msg.protocol_config.response_body_mode = mode.ProcessingMode.FULL_DUPLEX_STREAMED
    subset = msg.metadata_context.filter_metadata["envoy.lb.subset_hint"]
    lst = subset.fields["x-gateway-destination-endpoint-subset"].list_value
    lst.values.add().string_value = "10.0.0.1:8000"
    msg.observability_mode = False
    return msg


def test_processing_request_headers_roundtrip() -> None:
    ours = _request_headers()
    theirs = canon.ProcessingRequest.parse(ours.SerializeToString())
    assert [h.key for h in theirs.request_headers.headers.headers] == [":path", ":method", "x-request-id"]
    assert theirs.request_headers.headers.headers[0].raw_value == b"/v1/completions"
    assert int(theirs.protocol_config.request_body_mode) == 4
    assert int(theirs.protocol_config.response_body_mode) == 4
    md = theirs.metadata_context.filter_metadata["envoy.lb.subset_hint"]
    assert md.fields["x-gateway-destination-endpoint-subset"].list_value.values[0].string_value == "10.0.0.1:8000"
    back = pb.ProcessingRequest.FromString(bytes(theirs))
    assert back == ours


@pytest.mark.parametrize("kind", ["request_body", "response_body"])
def test_processing_request_body_roundtrip(kind: str) -> None:
    ours = pb.ProcessingRequest()
    getattr(ours, kind).body = b'{"model":"m"}' * 100
    getattr(ours, kind).end_of_stream = True
    theirs = canon.ProcessingRequest.parse(ours.SerializeToString())
    assert getattr(theirs, kind).body == b'{"model":"m"}' * 100
    assert getattr(theirs, kind).end_of_stream is True
    assert pb.ProcessingRequest.FromString(bytes(theirs)) == ours


@pytest.mark.parametrize("kind", ["request_trailers", "response_trailers", "response_headers"])
def test_processing_request_other_phases(kind: str) -> None:
    ours = pb.ProcessingRequest()
    part: Any = getattr(ours, kind)
    hm = part.trailers if "trailers" in kind else part.headers
    h = hm.headers.add()
    h.key = ":status" if kind == "response_headers" else "grpc-status"
    h.raw_value = b"200"
    theirs = canon.ProcessingRequest.parse(ours.SerializeToString())
    assert betterproto_oneof(theirs, "request") == kind
    assert pb.ProcessingRequest.FromString(bytes(theirs)) == ours


def betterproto_oneof(msg: Any, group: str) -> str:
    import betterproto2

    name, _ = betterproto2.which_one_of(msg, group)
    return name


def test_routed_headers_response_roundtrip() -> None:
    ours = R.routed_headers("10.0.0.1:8000,10.0.0.2:8000", 123, "rid", buffered=False)
    theirs = canon.ProcessingResponse.parse(ours.SerializeToString())
    common = theirs.request_headers.response
    assert common.clear_route_cache is True
    sets = {o.header.key: o.header.raw_value for o in common.header_mutation.set_headers}
    assert sets == {"x-gateway-destination-endpoint": b"10.0.0.1:8000,10.0.0.2:8000", "content-length": b"123",
                    "x-request-id": b"rid"}
    assert all(int(o.append_action) == int(canon_core.HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD)
               for o in common.header_mutation.set_headers)
    assert "x-gateway-destination-endpoint-subset" in common.header_mutation.remove_headers
    lb = theirs.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-gateway-destination-endpoint"].string_value == "10.0.0.1:8000,10.0.0.2:8000"
    assert pb.ProcessingResponse.FromString(bytes(theirs)) == ours


def test_buffered_routed_reply_is_a_body_response() -> None:
    ours = R.routed_headers("10.0.0.1:8000", None, None, buffered=True)
    theirs = canon.ProcessingResponse.parse(ours.SerializeToString())
    assert betterproto_oneof(theirs, "response") == "request_body"
    sets = [o.header.key for o in theirs.request_body.response.header_mutation.set_headers]
    assert sets == ["x-gateway-destination-endpoint"]


def test_the_prefiller_header_is_set_when_disaggregated_and_removed_otherwise() -> None:
    on = canon.ProcessingResponse.parse(R.routed_headers("10.0.0.2:8000", None, None, buffered=True,
                                                         prefiller="10.0.0.1:8000").SerializeToString())
    mutation = on.request_body.response.header_mutation
    sets = {o.header.key: o.header.raw_value for o in mutation.set_headers}
    assert sets["x-prefiller-host-port"] == b"10.0.0.1:8000"
    assert "x-prefiller-host-port" not in mutation.remove_headers  # set, not also removed: no order to rely on
    off = canon.ProcessingResponse.parse(R.routed_headers("10.0.0.2:8000", 12, None, buffered=False)
                                         .SerializeToString())
    mutation = off.request_headers.response.header_mutation
    assert "x-prefiller-host-port" in mutation.remove_headers
    assert "x-prefiller-host-port" not in {o.header.key for o in mutation.set_headers}


def test_streamed_body_chunks_roundtrip() -> None:
    body = bytes(range(256)) * 1000  # 256 KB
    chunks = R.body_chunks(body, request=True)
    assert len(chunks) == 5
    rebuilt = b""
    for i, c in enumerate(chunks):
        theirs = canon.ProcessingResponse.parse(c.SerializeToString())
        streamed = theirs.request_body.response.body_mutation.streamed_response
        assert len(streamed.body) <= R.BODY_CHUNK_BYTES
        assert streamed.end_of_stream is (i == len(chunks) - 1)
        rebuilt += streamed.body
        assert pb.ProcessingResponse.FromString(bytes(theirs)) == c
    assert rebuilt == body


def test_immediate_response_roundtrip() -> None:
    ours = R.immediate_error(EppError(ErrorCode.SERVICE_UNAVAILABLE, "no endpoints"))
    theirs = canon.ProcessingResponse.parse(ours.SerializeToString())
    imm = theirs.immediate_response
    assert int(imm.status.code) == 503
    assert orjson.loads(imm.body) == {"error": {"message": "no endpoints", "type": "ServiceUnavailableError",
                                                "param": None, "code": 503}}
    assert imm.headers.set_headers[0].header.key == "content-type"
    assert imm.headers.set_headers[0].header.raw_value == b"application/json"
    assert pb.ProcessingResponse.FromString(bytes(theirs)) == ours


@pytest.mark.parametrize("builder", [
    lambda: R.response_headers((("x-prefix-epp-decision", "endpoint=a"),)),
    lambda: R.empty_response_body(),
    lambda: R.empty_trailers(request=True),
    lambda: R.empty_trailers(request=False),
    lambda: R.empty_request_headers(),
    lambda: R.empty_request_body(),
])
def test_other_responses_roundtrip(builder: Any) -> None:
    ours = builder()
    theirs = canon.ProcessingResponse.parse(ours.SerializeToString())
    assert betterproto_oneof(theirs, "response") == ours.WhichOneof("response")
    assert pb.ProcessingResponse.FromString(bytes(theirs)) == ours


def test_canonical_encoding_decodes_with_ours() -> None:
    theirs = canon.ProcessingResponse(
        request_headers=canon.HeadersResponse(response=canon.CommonResponse(
            status=canon.CommonResponseResponseStatus.CONTINUE_AND_REPLACE,
            header_mutation=canon.HeaderMutation(
                set_headers=[canon_core.HeaderValueOption(header=canon_core.HeaderValue(key="k", raw_value=b"v"))],
                remove_headers=["r"]),
            body_mutation=canon.BodyMutation(body=b"x"),
            clear_route_cache=True)))
    ours = pb.ProcessingResponse.FromString(bytes(theirs))
    c = ours.request_headers.response
    assert c.status == pb.CommonResponse.CONTINUE_AND_REPLACE
    assert c.header_mutation.set_headers[0].header.raw_value == b"v"
    assert c.header_mutation.remove_headers == ["r"]
    assert c.body_mutation.body == b"x" and c.clear_route_cache
    hv = core.HeaderValue(key="a", value="b")
    assert canon_core.HeaderValue.parse(hv.SerializeToString()).value == "b"
