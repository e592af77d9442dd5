"""The served-endpoint report (x-gateway-destination-endpoint-served) on the response path: the
picker moves the in-flight count and the prefix-index record from its first choice to the
fallback that served the request, from the envoy.lb metadata or the response header, and only to
an endpoint of the list it returned."""

from __future__ import annotations

import pytest

from extproc.pb import external_processor_pb2 as pb
from extproc.transport.processor import StreamProcessor
from testkit.extproc_stream import body_msgs, completion, destination, headers_msg, make_app

SERVED = "x-gateway-destination-endpoint-served"


def response_headers(served: str, via: str) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    h = msg.response_headers.headers.headers.add()
    h.key, h.raw_value = ":status", b"200"
    if via == "header":
        h = msg.response_headers.headers.headers.add()
        h.key, h.raw_value = SERVED, served.encode()
    else:
        msg.metadata_context.filter_metadata["envoy.lb"].fields[SERVED].string_value = served
    return msg




@pytest.mark.parametrize("via", ["metadata", "header"])
async def test_fallback_that_served_gets_inflight_and_index(via: str) -> None:
    app = make_app(3, max_endpoints=3)
    prompt = completion("served elsewhere " * 60)
    proc = StreamProcessor(app.director, app.metrics, False)
    assert proc.on_request_headers(headers_msg()) == []
    [first] = body_msgs(prompt)
    dest = destination(proc.on_request_body(first.request_body)[0]).split(",")
    primary, fallback = app.datastore.get(dest[0]), app.datastore.get(dest[1])
    assert primary is not None and fallback is not None
    assert (primary.inflight, fallback.inflight) == (1, 0)
    assert app.index.held_by(primary.key) > 0

    msg = response_headers(fallback.key, via)
    proc.on_response_headers(msg.response_headers, msg)
    assert (primary.inflight, fallback.inflight) == (0, 1)
    assert app.index.held_by(primary.key) == 0 and app.index.held_by(fallback.key) > 0
    proc.on_response_trailers()
    assert (primary.inflight, fallback.inflight) == (0, 0)
    # The next request with the same prefix goes where the prefix really is.
    proc2 = StreamProcessor(app.director, app.metrics, False)
    proc2.on_request_headers(headers_msg())
    [again] = body_msgs(prompt)
    assert destination(proc2.on_request_body(again.request_body)[0]).split(",")[0] == fallback.key


@pytest.mark.parametrize("served", ["10.9.9.9:8000", "not an address", ""])
async def test_unknown_or_foreign_served_endpoint_changes_nothing(served: str) -> None:
    app = make_app(3, max_endpoints=2)
    proc = StreamProcessor(app.director, app.metrics, False)
    proc.on_request_headers(headers_msg())
    [body] = body_msgs(completion())
    dest = destination(proc.on_request_body(body.request_body)[0]).split(",")
    # the third endpoint exists in the pool but was not in the list returned for this request
    outsider = next(ep for ep in app.datastore.snapshot() if ep.key not in dest)
    for value in (served, outsider.key):
        msg = response_headers(value, "metadata")
        proc.on_response_headers(msg.response_headers, msg)
        primary = app.datastore.get(dest[0])
        assert primary is not None and primary.inflight == 1
        assert outsider.inflight == 0


async def test_served_equal_to_first_choice_keeps_everything() -> None:
    app = make_app(2, max_endpoints=2)
    proc = StreamProcessor(app.director, app.metrics, False)
    proc.on_request_headers(headers_msg())
    [body] = body_msgs(completion("same " * 80))
    dest = destination(proc.on_request_body(body.request_body)[0]).split(",")
    held = app.index.held_by(dest[0])
    msg = response_headers(dest[0], "header")
    proc.on_response_headers(msg.response_headers, msg)
    ep = app.datastore.get(dest[0])
    assert ep is not None and ep.inflight == 1 and app.index.held_by(dest[0]) == held
