"""The closed loop: usage from the response tail, predictions per scorer, the processor hook."""

from __future__ import annotations

import orjson
import pytest

from extproc.config.settings import KVEventsConfig
from extproc.control.usage import (
    Prediction,
    Usage,
    UsageSampler,
    UsageTail,
    UsageTracker,
    matched_bytes,
    parse_usage,
    predictions,
)
from extproc.core.datastore import EndpointSpec
from extproc.pb import envoy_processing_mode_pb2 as mode
from extproc.pb import external_processor_pb2 as pb
from testkit.extproc_stream import BUFFERED, body_msgs, completion, drive, headers_msg, make_app
from testkit.kvevents import events_stack


def sse(prompt_tokens: int, cached: int, chunks: int = 50, usage_each: bool = True) -> bytes:
    out = []
    for i in range(chunks):
        doc: dict[str, object] = {"id": "c", "choices": [{"index": 0, "text": f" tok{i} \"}}{{",
                                                           "finish_reason": None}]}
        if usage_each:
            doc["usage"] = None
        out.append(b"data: " + orjson.dumps(doc) + b"\n\n")
    final = {"id": "c", "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": chunks,
                                                 "prompt_tokens_details": {"cached_tokens": cached}}}
    out.append(b"data: " + orjson.dumps(final) + b"\n\ndata: [DONE]\n\n")
    return b"".join(out)


def tail_of(data: bytes, chunk: int) -> bytes:
    tail = UsageTail()
    for i in range(0, len(data), chunk):
        tail.feed(data[i:i + chunk])
    return tail.tail()


@pytest.mark.parametrize("chunk", [1, 7, 100, 1 << 20])
def test_usage_from_a_streamed_tail_whatever_the_chunking(chunk: int) -> None:
    body = sse(1234, 1008, chunks=400)
    tail = tail_of(body, chunk)
    assert len(tail) <= 8192 < len(body)
    assert parse_usage(tail) == Usage(1234, 1008)


def test_usage_from_plain_json_bodies_and_its_absence() -> None:
    big = {"id": "x", "choices": [{"text": "y" * 20_000}], "usage": {"prompt_tokens": 50, "total_tokens": 60,
                                                                     "prompt_tokens_details": {"cached_tokens": 32}}}
    assert parse_usage(tail_of(orjson.dumps(big), 4096)) == Usage(50, 32)
    assert parse_usage(tail_of(sse(10, 0, usage_each=False)[:-60] + b"data: [DONE]\n\n", 64)) is None
    no_details = {"usage": {"prompt_tokens": 50, "completion_tokens": 3}}
    assert parse_usage(orjson.dumps(no_details)) is None  # no cached_tokens reported: nothing to compare
    assert parse_usage(b'{"error": {"message": "boom", "code": 500}}') is None
    usage_first = orjson.dumps({"usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}},
                                "choices": [{"text": "z" * 10_000}]})
    assert parse_usage(tail_of(usage_first, 1000)) is None  # only the tail is kept


def test_usage_in_the_responses_and_messages_shapes() -> None:
    """vLLM's Responses usage counts the whole prompt in input_tokens; its Anthropic usage counts
    input_tokens after the cached part, which is cache_read_input_tokens."""
    responses = {"type": "response.completed", "response": {"output": [{"text": "w" * 9000}], "usage": {
        "input_tokens": 300, "output_tokens": 8, "total_tokens": 308,
        "input_tokens_details": {"cached_tokens": 256, "cache_write_tokens": 0}}}}
    body = b"event: response.completed\ndata: " + orjson.dumps(responses) + b"\n\n"
    assert parse_usage(tail_of(body, 512)) == Usage(300, 256)
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 44, "output_tokens": 0}}}
    delta = {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
             "usage": {"input_tokens": 44, "output_tokens": 4, "cache_read_input_tokens": 256}}
    stream = b"".join(b"event: " + str(e["type"]).encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n"
                      for e in (start, delta, {"type": "message_stop"}))
    assert parse_usage(tail_of(stream, 7)) == Usage(300, 256)
    created = {"usage": {"input_tokens": 4, "cache_read_input_tokens": 64, "cache_creation_input_tokens": 32}}
    assert parse_usage(orjson.dumps(created)) == Usage(100, 64)
    assert parse_usage(orjson.dumps(start["message"])) is None  # no cached count yet: nothing to compare
    assert parse_usage(b'{"usage": {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 11}}}') is None


def test_predictions_per_scorer() -> None:
    # 3 segments of 100, 50 and 10 bytes in 64-byte blocks: 2 + 1 + 1 blocks.
    assert [matched_bytes([100, 50, 10], 64, n) for n in range(5)] == [0, 64, 100, 150, 160]
    usage = Usage(prompt_tokens=400, cached_tokens=384)
    # approximate: 1000 of 1600 bytes -> 250 tokens -> 240 (15 blocks of 16)
    p = Prediction(block_size=16, approx_matched_bytes=1000, prompt_bytes=1600, precise_blocks=24,
                   precise_enabled=True)
    assert predictions(p, usage) == {"approximate": 240, "precise": 384}
    # capped by what vLLM can reuse: (400 - 1) // 16 = 24 blocks
    full = Prediction(16, 1600, 1600, 25, True)
    assert predictions(full, usage) == {"approximate": 384, "precise": 384}
    fallback = Prediction(16, 1000, 1600, None, True)  # events unusable: precise predicts as approximate
    assert predictions(fallback, usage) == {"approximate": 240, "precise": 240}
    assert predictions(Prediction(16, 1000, 1600, None, False), usage) == {"approximate": 240}
    reports: list[tuple[Usage, dict[str, int], int]] = []
    tracker = UsageTracker(p, lambda *r: reports.append(r))
    tracker.feed(sse(400, 384))
    assert tracker.finish() == {"approximate": 240, "precise": 384}
    assert reports == [(usage, {"approximate": 240, "precise": 384}, 16)]  # once per response


def response_headers() -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    h = msg.response_headers.headers.headers.add()
    h.key, h.raw_value = ":status", b"200"
    return msg


async def test_processor_feeds_the_closed_loop_for_both_scorers() -> None:
    app = make_app(1, kv_events=KVEventsConfig(enabled=True), usage_sample_rate=1.0)
    prompt = "hello " * 200  # 1200 bytes, 200 builtin tokens
    sample = app.metrics.registry.get_sample_value
    for cached in (0, 192):
        msgs = [headers_msg(), *body_msgs(completion(prompt)), response_headers(),
                *body_msgs(sse(200, cached), 100, response=True)]
        await drive(app, msgs)
    assert sample("prefix_epp_cached_tokens_predictions_total", {"scorer": "approximate"}) == 2
    assert sample("prefix_epp_cached_tokens_predictions_total", {"scorer": "precise"}) == 2
    # Both predicted 0 then 192 (the manager is not running, so precise fell back): all within a block.
    assert sample("prefix_epp_cached_tokens_predicted_within_one_block_total", {"scorer": "approximate"}) == 2
    assert sample("prefix_epp_cached_tokens_prediction_error_tokens_sum", {"scorer": "precise"}) == 0


async def test_remote_tokenizer_is_awaited_before_routing() -> None:
    async with events_stack() as ev:
        rep = ev.replicas[0]
        app = make_app(0, kv_events=KVEventsConfig(prefix_scorer="precise", tokenizer="remote"),
                       refresh_metrics_interval_s=0)
        app.datastore.set_endpoints([EndpointSpec("127.0.0.1", rep.port)])
        assert app.director.tokenizes_async
        body = orjson.dumps({"model": "sim-model", "prompt": "remote tokens " * 40})
        try:
            for _ in range(2):
                out = await drive(app, [headers_msg(), *body_msgs(body), response_headers()], explain=True)
        finally:
            await app.stop()
        explain = out[2].response_headers.response.header_mutation.set_headers[0].header.raw_value.decode()
        # 81 engine tokens -> 5 blocks; the first request's speculative entries match the second.
        assert "precise=5/5 (approximate fallback)" in explain, explain


def test_usage_sampler_takes_its_share_evenly() -> None:
    assert not any(UsageSampler(0.0).take() for _ in range(1000))
    assert all(UsageSampler(1.0).take() for _ in range(1000))
    quarter = UsageSampler(0.25)
    assert [quarter.take() for _ in range(8)] == [False, False, False, True] * 2
    percent = UsageSampler(0.01)
    assert sum(percent.take() for _ in range(10_000)) == 100
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="sample rate"):
            UsageSampler(bad)


def buffered_headers() -> pb.ProcessingRequest:
    """The default wiring: a buffered request body, no response body unless the picker asks for it."""
    msg = headers_msg(body_mode=BUFFERED)
    msg.protocol_config.response_body_mode = mode.ProcessingMode.NONE  # type: ignore[assignment]
    return msg


@pytest.mark.parametrize("wiring", ["buffered", "full-duplex"])
@pytest.mark.parametrize(("scorer", "rate", "explain", "tokenized"), [
    ("approximate", 0.0, False, False),  # --kv-events alone: nothing compared, nothing tokenized
    ("approximate", 1.0, False, True),  # the sampled request's two predictions are compared
    ("approximate", 0.0, True, True),  # an explained decision shows the precise match too
    ("precise", 0.0, False, True),  # precise routing tokenizes every request
])
async def test_kv_events_alone_tokenizes_only_the_requests_it_compares(
        wiring: str, scorer: str, rate: float, explain: bool, tokenized: bool) -> None:
    app = make_app(1, kv_events=KVEventsConfig(enabled=True, prefix_scorer=scorer), usage_sample_rate=rate)
    assert app.kv_events is not None
    recorded: list[int] = []  # the precise index's speculative records: one per tokenized request
    app.kv_events.on_record(lambda _endpoint, keys: recorded.append(len(keys)))
    head = buffered_headers() if wiring == "buffered" else headers_msg()
    prompt = "hello " * 200  # 200 builtin tokens: 12 blocks of 16
    await drive(app, [head, *body_msgs(completion(prompt)), response_headers(),
                      *body_msgs(sse(200, 0), 100, response=True)], explain=explain)
    assert recorded == ([12] if tokenized else [])
    compared = app.metrics.registry.get_sample_value("prefix_epp_cached_tokens_predictions_total",
                                                     {"scorer": "precise"})
    assert (compared or 0) == (1 if rate == 1.0 else 0)
