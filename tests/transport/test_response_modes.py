"""The response path: per-request mode_override, the usage sample, echoes, message counts."""

from __future__ import annotations

import orjson

from extproc.pb import envoy_processing_mode_pb2 as mode
from extproc.pb import external_processor_pb2 as pb
from extproc.transport.responses import BODY_CHUNK_BYTES
from testkit.extproc_stream import BUFFERED, DUPLEX, body_msgs, completion, drive, headers_msg, make_app

NONE = mode.ProcessingMode.NONE
STREAMED = mode.ProcessingMode.STREAMED
SEND = mode.ProcessingMode.SEND


def with_modes(msg: pb.ProcessingRequest, request: int, response: int) -> pb.ProcessingRequest:
    msg.protocol_config.request_body_mode = request  # type: ignore[assignment]
    msg.protocol_config.response_body_mode = response  # type: ignore[assignment]
    return msg


def response_headers() -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    h = msg.response_headers.headers.headers.add()
    h.key, h.raw_value = ":status", b"200"
    return msg


def sse_with_usage(prompt_tokens: int, cached: int) -> bytes:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": cached}}
    return (b'data: {"choices": [{"text": "a"}]}\n\n' * 3
            + b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")


def predictions(app: object) -> float:
    value = app.metrics.registry.get_sample_value(  # type: ignore[attr-defined]
        "prefix_epp_cached_tokens_predictions_total", {"scorer": "approximate"})
    return float(value or 0.0)


async def test_override_asks_for_the_sampled_bodies_only_and_always_for_headers_and_trailers() -> None:
    app = make_app(usage_sample_rate=0.5)
    overrides = []
    for explain in (False, False, True, True):
        out = await drive(app, [with_modes(headers_msg(body_mode=BUFFERED), BUFFERED, NONE),
                                *body_msgs(completion())], explain=explain)
        reply = out[0]  # the request_headers reply, where Envoy honours mode_override
        assert reply.HasField("request_headers") and reply.HasField("mode_override")
        o = reply.mode_override
        assert o.response_trailer_mode == SEND and o.request_body_mode == BUFFERED
        assert o.response_header_mode == SEND  # always: the response's status is its outcome
        overrides.append(o.response_body_mode)
        assert not any(r.HasField("mode_override") for r in out[1:])
    assert overrides == [NONE, STREAMED, NONE, STREAMED]  # 0.5: every second request, evenly
    bodiless = await drive(app, [with_modes(headers_msg("/v1/models", eos=True, body_mode=BUFFERED), BUFFERED, NONE)])
    assert bodiless[0].mode_override.response_trailer_mode == SEND  # in flight until its response ends


async def test_no_override_while_a_body_mode_is_full_duplex() -> None:
    app = make_app(usage_sample_rate=1.0)
    for request, response in ((DUPLEX, NONE), (BUFFERED, DUPLEX), (DUPLEX, DUPLEX)):
        out = await drive(app, [with_modes(headers_msg(body_mode=request), request, response),
                                *body_msgs(completion()), response_headers()])
        assert not any(r.HasField("mode_override") for r in out)  # Envoy would ignore it


async def test_sampled_streamed_body_feeds_the_closed_loop_with_empty_replies() -> None:
    app = make_app(1, usage_sample_rate=1.0)
    sse = sse_with_usage(60, 0)
    out = await drive(app, [with_modes(headers_msg(body_mode=BUFFERED), BUFFERED, NONE), *body_msgs(completion()),
                            response_headers(), *body_msgs(sse, 40, response=True)])
    bodies = [r for r in out if r.HasField("response_body")]
    assert len(bodies) == len(body_msgs(sse, 40))
    assert all(not r.response_body.response.HasField("body_mutation") for r in bodies)  # STREAMED: pass as is
    assert predictions(app) == 1
    assert all(ep.inflight == 0 for ep in app.datastore.snapshot())


async def test_full_duplex_responses_are_echoed_and_parsed_only_when_sampled() -> None:
    for rate, expected in ((0.0, 0), (1.0, 1)):
        app = make_app(1, usage_sample_rate=rate)
        sse = sse_with_usage(60, 0)
        out = await drive(app, [headers_msg(), *body_msgs(completion()), response_headers(),
                                *body_msgs(sse, 50, response=True)])
        echoed = b"".join(r.response_body.response.body_mutation.streamed_response.body
                          for r in out if r.HasField("response_body"))
        assert echoed == sse
        assert predictions(app) == expected


async def test_full_duplex_request_body_is_echoed_chunk_by_chunk() -> None:
    app = make_app(1)
    body = completion("x" * 150_000)
    msgs = body_msgs(body, 70_000)  # 70,000-byte chunks: each over the 62,000-byte limit, split in two
    out = await drive(app, [headers_msg(), *msgs])
    chunks = [r.request_body.response.body_mutation.streamed_response for r in out if r.HasField("request_body")]
    assert b"".join(c.body for c in chunks) == body
    assert all(len(c.body) <= BODY_CHUNK_BYTES for c in chunks)
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert len(chunks) == 2 * len(msgs) - (1 if len(msgs[-1].request_body.body) <= BODY_CHUNK_BYTES else 0)


async def test_messages_are_counted_by_kind() -> None:
    app = make_app(1)
    trailers = pb.ProcessingRequest()
    trailers.response_trailers.SetInParent()
    await drive(app, [headers_msg(), *body_msgs(completion(), 100), response_headers(), trailers])
    count = app.metrics.registry.get_sample_value
    assert count("prefix_epp_extproc_messages_total", {"kind": "request_headers"}) == 1
    assert count("prefix_epp_extproc_messages_total", {"kind": "request_body"}) == len(body_msgs(completion(), 100))
    assert count("prefix_epp_extproc_messages_total", {"kind": "response_headers"}) == 1
    assert count("prefix_epp_extproc_messages_total", {"kind": "response_trailers"}) == 1
    assert count("prefix_epp_extproc_messages_total", {"kind": "response_body"}) == 0


async def test_responses_requests_ask_for_the_body_and_learn_the_id_where_it_was_served() -> None:
    """A /v1/responses request: the override asks for the response body (unsampled), the id it
    carries is recorded on the endpoint, and the next turn's previous_response_id finds it there."""
    app = make_app(usage_sample_rate=0.0)
    first = orjson.dumps({"model": "m", "input": "the first turn"})
    out = await drive(app, [with_modes(headers_msg("/v1/responses", body_mode=BUFFERED), BUFFERED, NONE),
                            *body_msgs(first), *body_msgs(b'{"id": "resp_42", "output": []}', 8, response=True)])
    assert out[0].mode_override.response_body_mode == STREAMED
    served = next(r for r in out if r.HasField("request_body")).request_body.response.header_mutation
    home = next(h.header.raw_value.decode() for h in served.set_headers
                if h.header.key == "x-gateway-destination-endpoint")
    other = orjson.dumps({"model": "m", "input": "nothing shared at all", "previous_response_id": "resp_42"})
    for _ in range(3):
        out = await drive(app, [with_modes(headers_msg("/v1/responses", body_mode=BUFFERED), BUFFERED, NONE),
                                *body_msgs(other)])
        hdrs = next(r for r in out if r.HasField("request_body")).request_body.response.header_mutation
        assert home in [h.header.raw_value.decode() for h in hdrs.set_headers]
    chat = await drive(app, [with_modes(headers_msg("/v1/chat/completions", body_mode=BUFFERED), BUFFERED, NONE),
                             *body_msgs(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}))])
    assert chat[0].mode_override.response_body_mode == NONE  # only /v1/responses needs its body read
