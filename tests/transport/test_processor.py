"""The ext_proc state machine, driven message by message without gRPC."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

import pytest

from extproc.pb import envoy_processing_mode_pb2 as mode
from extproc.pb import external_processor_pb2 as pb
from extproc.transport.processor import EXPLAIN_HEADER, StreamProcessor
from testkit.extproc_stream import (
    BUFFERED,
    body_msgs,
    completion,
    destination,
    drive,
    error_body,
    headers_msg,
    make_app,
)


async def test_full_duplex_sequence_headers_then_body_chunks() -> None:
    app = make_app()
    body = completion("z" * 150_000)
    out = await drive(app, [headers_msg(), *body_msgs(body, chunk=40_000)])
    assert out[0].WhichOneof("response") == "request_headers"
    dest = destination(out[0])
    assert dest in {ep.key for ep in app.datastore.snapshot()}
    sets = {o.header.key: o.header.raw_value for o in out[0].request_headers.response.header_mutation.set_headers}
    assert sets["content-length"] == str(len(body)).encode()
    assert "x-request-id" in sets  # generated when the client sent none
    chunks = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert all(len(c.body) <= 62000 for c in chunks)
    assert b"".join(c.body for c in chunks) == body
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]


async def test_buffered_mode_answers_headers_then_routes_in_body_reply() -> None:
    app = make_app()
    out = await drive(app, [headers_msg(body_mode=BUFFERED), *body_msgs(completion())])
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    assert not out[0].request_headers.response.header_mutation.set_headers
    destination(out[1])
    assert not out[1].request_body.response.body_mutation.HasField("streamed_response")


async def test_request_trailers_end_the_body_and_are_answered_last() -> None:
    app = make_app()
    msgs = [headers_msg(), *body_msgs(completion())]
    msgs[-1].request_body.end_of_stream = False
    trailers = pb.ProcessingRequest()
    trailers.request_trailers.SetInParent()
    out = await drive(app, [*msgs, trailers])
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body", "request_trailers"]


async def test_bodiless_request_routed_at_once() -> None:
    app = make_app()
    out = await drive(app, [headers_msg("/v1/models", eos=True)])
    assert len(out) == 1 and out[0].WhichOneof("response") == "request_headers"
    assert destination(out[0]) in {ep.key for ep in app.datastore.snapshot()}


@pytest.mark.parametrize(("body", "status", "text"), [
    (b'{"model": "m", "prompt": ', 400, "request body is not valid JSON"),
    (b'[1]', 400, "request body must be a JSON object"),
    (b'{"prompt": "x"}', 400, "model not found in request body"),
])
async def test_bad_bodies_get_400(body: bytes, status: int, text: str) -> None:
    app = make_app()
    out = await drive(app, [headers_msg(), *body_msgs(body)])
    assert len(out) == 1
    imm = out[0].immediate_response
    assert imm.status.code == status
    err = error_body(imm)
    assert str(err["message"]).startswith(text) and err["type"] == "BadRequestError"
    assert all(ep.inflight == 0 for ep in app.datastore.snapshot())


async def test_oversized_body_gets_413_and_is_not_buffered() -> None:
    app = make_app(max_request_body_bytes=100_000)
    big = completion("x" * 150_000)
    out = await drive(app, [headers_msg(), *body_msgs(big, chunk=60_000)])
    assert len(out) == 1
    imm = out[0].immediate_response
    assert imm.status.code == 413
    assert error_body(imm)["message"] == "request body exceeds 100000 bytes"
    ok = await drive(app, [headers_msg(), *body_msgs(completion("x" * 50_000))])
    assert ok[0].WhichOneof("response") == "request_headers"


async def test_no_endpoints_503() -> None:
    app = make_app(0)
    out = await drive(app, [headers_msg(), *body_msgs(completion())])
    assert out[0].immediate_response.status.code == 503
    assert error_body(out[0].immediate_response)["type"] == "ServiceUnavailableError"
    out = await drive(app, [headers_msg("/v1/models", eos=True)])
    assert out[0].immediate_response.status.code == 503


async def test_subset_hint_restricts_and_empty_subset_is_503() -> None:
    app = make_app()
    for _ in range(10):
        out = await drive(app, [headers_msg(subset=["10.0.0.2:8000"]), *body_msgs(completion())])
        assert destination(out[0]) == "10.0.0.2:8000"
    out = await drive(app, [headers_msg(subset=["10.0.0.3"]), *body_msgs(completion())])
    assert destination(out[0]) == "10.0.0.3:8000"  # bare IP matches
    out = await drive(app, [headers_msg(subset=[]), *body_msgs(completion())])
    assert out[0].immediate_response.status.code == 503
    out = await drive(app, [headers_msg(subset=["10.9.9.9:8000"]), *body_msgs(completion())])
    assert out[0].immediate_response.status.code == 503


async def test_subset_hint_ignored_when_disabled() -> None:
    app = make_app(disable_endpoint_subset_filter=True)
    out = await drive(app, [headers_msg(subset=[]), *body_msgs(completion())])
    assert out[0].WhichOneof("response") == "request_headers"


async def test_test_epp_endpoint_selection_header_with_its_flag() -> None:
    app = make_app(test_endpoint_selection=True)
    seen = set()
    for i in range(20):
        sel = ("test-epp-endpoint-selection", "10.0.0.1,10.0.0.3:8000")
        out = await drive(app, [headers_msg(extra=[sel]), *body_msgs(completion(f"p{i}" * 40))])
        seen.add(destination(out[0]))
    assert seen == {"10.0.0.1:8000", "10.0.0.3:8000"}
    # A guessed address outside the pool and a pool member filtered out read the same: nothing
    # in the reply names the header or the address.
    out = await drive(app, [headers_msg(extra=[("test-epp-endpoint-selection", "10.1.1.1")]),
                            *body_msgs(completion())])
    imm = out[0].immediate_response
    assert imm.status.code == 503
    assert error_body(imm)["message"] == "no eligible endpoint for this request"
    assert b"10.1.1.1" not in imm.body and b"test-epp" not in imm.body


async def test_test_epp_endpoint_selection_header_is_ignored_and_counted_by_default() -> None:
    """The attack: any client pins its request to an endpoint of its choosing (or probes which
    addresses are in the pool from the 503s). Without the flag the header changes nothing."""
    app = make_app()
    seen = set()
    for i in range(30):
        sel = ("test-epp-endpoint-selection", "10.0.0.2:8000")
        out = await drive(app, [headers_msg(extra=[sel]), *body_msgs(completion(f"q{i} " * 40))])
        seen.add(destination(out[0]))
    assert seen == {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
    out = await drive(app, [headers_msg(extra=[("test-epp-endpoint-selection", "10.1.1.1")]),
                            *body_msgs(completion())])
    assert out[0].WhichOneof("response") == "request_headers"  # routed, not 503
    # Bytes that are not UTF-8 in an ignored header are not read, so they fail nothing.
    msg = headers_msg()
    h = msg.request_headers.headers.headers.add()
    h.key, h.raw_value = "test-epp-endpoint-selection", b"\xff\xfe"
    out = await drive(app, [msg, *body_msgs(completion())])
    assert out[0].WhichOneof("response") == "request_headers"
    assert app.metrics.registry.get_sample_value(
        "prefix_epp_ignored_headers_total", {"header": "test-epp-endpoint-selection"}) == 32


async def test_forged_destination_is_overwritten_and_subset_header_removed() -> None:
    app = make_app()
    forged = [("x-gateway-destination-endpoint", "6.6.6.6:80"), ("x-gateway-destination-endpoint-subset", "6.6.6.6:80")]
    out = await drive(app, [headers_msg(extra=forged), *body_msgs(completion())])
    common = out[0].request_headers.response
    opt = next(o for o in common.header_mutation.set_headers if o.header.key == "x-gateway-destination-endpoint")
    assert opt.header.raw_value.decode() != "6.6.6.6:80"
    assert opt.append_action == opt.OVERWRITE_IF_EXISTS_OR_ADD
    assert "x-gateway-destination-endpoint-subset" in common.header_mutation.remove_headers


async def test_fallback_list_ordered_best_first() -> None:
    app = make_app(max_endpoints=3)
    prompt = completion("shared " * 100)
    first = destination((await drive(app, [headers_msg(), *body_msgs(prompt)]))[0]).split(",")
    assert len(first) == 3 and len(set(first)) == 3
    again = destination((await drive(app, [headers_msg(), *body_msgs(prompt)]))[0]).split(",")
    assert again[0] == first[0]  # the warm endpoint leads the list


async def test_response_path_passthrough_and_explain_header() -> None:
    app = make_app()
    resp_headers = pb.ProcessingRequest()
    h = resp_headers.response_headers.headers.headers.add()
    h.key, h.raw_value = ":status", b"200"
    sse = b"data: {\"x\": 1}\n\n" * 5000 + b"data: [DONE]\n\n"
    trailers = pb.ProcessingRequest()
    trailers.response_trailers.SetInParent()
    msgs = [headers_msg(), *body_msgs(completion()), resp_headers, *body_msgs(sse, 30_000, response=True), trailers]
    out = await drive(app, msgs, explain=True)
    kinds = [r.WhichOneof("response") for r in out]
    assert kinds[:2] == ["request_headers", "request_body"]
    rh = out[2].response_headers.response.header_mutation.set_headers
    assert rh[0].header.key == EXPLAIN_HEADER and b"matched=" in rh[0].header.raw_value
    bodies = [r.response_body.response.body_mutation.streamed_response for r in out if r.HasField("response_body")]
    assert b"".join(b.body for b in bodies) == sse and bodies[-1].end_of_stream
    assert kinds[-1] == "response_trailers"
    assert all(ep.inflight == 0 for ep in app.datastore.snapshot())


async def test_inflight_held_until_response_end_and_released_on_cancel() -> None:
    app = make_app(1)
    ep = app.datastore.snapshot()[0]
    proc = StreamProcessor(app.director, app.metrics, False)
    msgs = [headers_msg(), *body_msgs(completion())]

    async def gen() -> AsyncIterator[pb.ProcessingRequest]:
        for m in msgs:
            yield m

    stream = proc.run(gen())
    assert isinstance(stream, AsyncGenerator)
    await stream.__anext__()
    assert ep.inflight == 1
    await stream.aclose()  # Envoy reset / client gone
    assert ep.inflight == 0


async def test_removed_endpoint_purged_from_index() -> None:
    app = make_app(2)
    prompt = completion("index me " * 40)
    dest = destination((await drive(app, [headers_msg(), *body_msgs(prompt)]))[0])
    assert app.index.held_by(dest) > 0
    app.datastore.remove(dest)
    assert app.index.held_by(dest) == 0
    for _ in range(5):
        assert destination((await drive(app, [headers_msg(), *body_msgs(prompt)]))[0]) != dest


async def test_unexpected_exception_becomes_500_with_request_id_and_is_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    app = make_app()
    secret = "TOP-SECRET-PROMPT"

    def boom(*_a: object) -> None:
        raise RuntimeError(f"scheduler exploded on {secret}")

    app.director.scheduler.schedule = boom  # type: ignore[method-assign,assignment]
    rid = ("x-request-id", "req-42")
    with caplog.at_level("INFO", logger="prefix_epp.extproc"):
        out = await drive(app, [headers_msg(extra=[rid]), *body_msgs(completion(secret))])
    assert len(out) == 1
    imm = out[0].immediate_response
    assert imm.status.code == 500
    err = error_body(imm)
    assert err["type"] == "InternalServerError" and "req-42" in str(err["message"])
    assert {o.header.key: o.header.raw_value for o in imm.headers.set_headers}["x-request-id"] == b"req-42"
    errors = [r for r in caplog.records if r.getMessage() == "internal error"]
    assert len(errors) == 1 and errors[0].request_id == "req-42"  # type: ignore[attr-defined]
    assert errors[0].exception == "RuntimeError"  # type: ignore[attr-defined]
    assert all(secret not in r.getMessage() and secret not in str(r.__dict__) for r in caplog.records)
    assert app.metrics.registry.get_sample_value(
        "prefix_epp_requests_total", {"outcome": "error", "status": "500"}) == 1
    assert all(ep.inflight == 0 for ep in app.datastore.snapshot())


async def test_fault_after_routing_releases_inflight() -> None:
    app = make_app(1)

    def boom(*_a: object) -> None:
        raise ValueError("usage tracker broke")

    app.director.track_usage = boom  # type: ignore[method-assign,assignment]
    out = await drive(app, [headers_msg(), *body_msgs(completion())])
    assert out[-1].immediate_response.status.code == 500
    assert app.datastore.snapshot()[0].inflight == 0


@pytest.mark.parametrize("header", ["test-epp-endpoint-selection", "x-gateway-inference-objective",
                                    ":path", "x-request-id"])
async def test_header_bytes_that_are_not_utf8_get_400(header: str) -> None:
    app = make_app(test_endpoint_selection=True)
    msg = headers_msg()
    h = msg.request_headers.headers.headers.add()
    h.key, h.raw_value = header, b"\xff\xfe bad"
    out = await drive(app, [msg, *body_msgs(completion())])
    assert len(out) == 1
    imm = out[0].immediate_response
    assert imm.status.code == 400
    assert error_body(imm)["message"] == f"header {header} is not valid UTF-8"


@pytest.mark.parametrize("mode_value", [mode.ProcessingMode.STREAMED, mode.ProcessingMode.BUFFERED_PARTIAL,
                                        mode.ProcessingMode.NONE])
async def test_unsupported_body_modes_refused_at_the_first_message(
        mode_value: int, caplog: pytest.LogCaptureFixture) -> None:
    app = make_app()
    name = mode.ProcessingMode.BodySendMode.Name(mode_value)
    with caplog.at_level("INFO", logger="prefix_epp.extproc"):
        # Only the headers are sent: a picker waiting for a body (NONE never sends one) would hang here.
        out = await drive(app, [headers_msg(body_mode=mode_value)])
    assert len(out) == 1
    imm = out[0].immediate_response
    assert imm.status.code == 500
    assert name in str(error_body(imm)["message"])
    assert any(name in str(r.__dict__) for r in caplog.records)
    # A bodiless request needs no body mode and is still routed.
    out = await drive(app, [headers_msg("/v1/models", eos=True, body_mode=mode_value)])
    assert out[0].WhichOneof("response") == "request_headers"


def _with_length(msg: pb.ProcessingRequest, n: int) -> pb.ProcessingRequest:
    h = msg.request_headers.headers.headers.add()
    h.key, h.raw_value = "content-length", str(n).encode()
    return msg


async def test_global_buffered_bytes_budget_429_when_chunks_stop_fitting() -> None:
    app = make_app(max_request_body_bytes=80_000, max_buffered_bytes=80_000)
    body = completion("y" * 50_000)
    held = StreamProcessor(app.director, app.metrics, False, app.body_budget)
    queue: list[pb.ProcessingRequest] = [_with_length(headers_msg(), len(body)), *body_msgs(body, chunk=20_000)]
    first_chunks = queue[:3]

    async def slow() -> AsyncIterator[pb.ProcessingRequest]:
        for m in first_chunks:
            yield m
        await gate.wait()
        for m in queue[3:]:
            yield m

    import asyncio

    gate = asyncio.Event()
    collected: list[pb.ProcessingResponse] = []

    async def consume() -> None:
        collected.extend([r async for r in held.run(slow())])

    task = asyncio.create_task(consume())
    for _ in range(100):
        if app.body_budget.used == 40_000:
            break
        await asyncio.sleep(0)
    assert app.body_budget.used == 40_000  # the bytes received so far
    # A chunked body without content-length is refused when its chunks stop fitting.
    out = await drive(app, [headers_msg(), *body_msgs(body, chunk=20_000)])
    imm = out[-1].immediate_response
    assert imm.status.code == 429 and error_body(imm)["type"] == "RateLimitError"
    assert {o.header.key: o.header.raw_value for o in imm.headers.set_headers}["retry-after"] == b"1"
    assert app.body_budget.used == 40_000
    gate.set()
    await task
    assert collected[0].WhichOneof("response") == "request_headers"  # the other one is untouched
    assert b"".join(r.request_body.response.body_mutation.streamed_response.body for r in collected[1:]) == body
    assert app.body_budget.used == 0
    ok = await drive(app, [_with_length(headers_msg(), len(body)), *body_msgs(body)])
    assert ok[0].WhichOneof("response") == "request_headers"
    assert app.body_budget.used == 0


async def test_declared_length_over_the_request_limit_is_413_before_the_body() -> None:
    app = make_app(max_request_body_bytes=1000)
    out = await drive(app, [_with_length(headers_msg(), 5000)])
    assert out[0].immediate_response.status.code == 413
    assert app.body_budget.used == 0
