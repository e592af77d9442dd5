"""Property-based fuzzing of the ext_proc stream state machine (hypothesis).

Random message orders, chunkings, processing modes, header bytes and bodies (invalid JSON, wrong
types, deep nesting, huge numbers, invalid UTF-8, empty and enormous fields) are driven through
`StreamProcessor.run`. Every stream must end without raising, every ImmediateResponse must be the
last reply and carry a JSON error body, a complete request must get an answer, and in-flight counts
and the buffered-bytes budget must return to zero.

Case count: FUZZ_EXAMPLES per property (CI: 150; `make fuzz`: 50,000 each, 100,000 in all).
CI runs derandomized (the same cases every run); `make fuzz` draws fresh ones.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections.abc import AsyncIterator, Iterator, Sequence

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.config.settings import EppConfig
from extproc.core.datastore import EndpointSpec
from extproc.pb import envoy_processing_mode_pb2 as mode
from extproc.pb import external_processor_pb2 as pb
from extproc.runtime.app import App
from extproc.transport.processor import StreamProcessor

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
FRESH = os.environ.get("FUZZ_FRESH", "") == "1"
STATUSES = {400, 404, 413, 429, 500, 503}
MODES = [mode.ProcessingMode.NONE, mode.ProcessingMode.STREAMED, mode.ProcessingMode.BUFFERED,
         mode.ProcessingMode.BUFFERED_PARTIAL, mode.ProcessingMode.FULL_DUPLEX_STREAMED]
HEADER_KEYS = [":path", ":method", "x-request-id", "test-epp-endpoint-selection", "x-gateway-inference-objective",
               "content-length", "x-gateway-destination-endpoint", "x-other"]
PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/models", "/", "/x?y=1"]

FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not FRESH,
                suppress_health_check=list(HealthCheck), print_blob=True)


def _app() -> App:
    # Small limits so that 413 and 429 are reached by the fuzzer, too; the test-epp-endpoint-selection
    # header honoured, so its parsing is fuzzed (ignored, it is not read at all).
    app = App(EppConfig(seed=1, max_request_body_bytes=300_000, max_buffered_bytes=400_000,
                        test_endpoint_selection=True))
    app.datastore.set_endpoints(EndpointSpec(f"10.0.0.{i}", 8000) for i in range(1, 4))
    app.datastore.synced = True
    return app


@pytest.fixture(scope="module")
def app() -> App:
    return _app()


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.run_until_complete(lp.shutdown_asyncgens())
    lp.close()


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                      st.floats(), st.text(max_size=40))
json_value = st.recursive(json_leaf, lambda c: st.one_of(st.lists(c, max_size=4),
                                                           st.dictionaries(st.text(max_size=8), c, max_size=4)),
                          max_leaves=12)


def _dumps(value: object) -> bytes:
    """The standard library's encoder: integers beyond 64 bits and Infinity pass (orjson refuses them)."""
    return json.dumps(value, ensure_ascii=False).encode()


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["completion", "chat", "responses", "wrong_types", "random_json", "invalid_json",
                                 "binary", "deep", "huge_number", "bad_utf8", "empty", "enormous"]))
    model = draw(st.one_of(st.text(max_size=30), st.sampled_from(["m", "llama", ""])))
    if kind == "completion":
        return _dumps({"model": model, "prompt": draw(st.text(max_size=300)), "stream": draw(st.booleans())})
    if kind == "chat":
        msgs = draw(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                    "content": st.one_of(st.text(max_size=80), json_value)}),
                             max_size=5))
        return _dumps({"model": model, "messages": msgs, "tools": draw(json_value)})
    if kind == "responses":
        return _dumps({"model": model, "input": draw(json_value), "instructions": draw(json_value)})
    if kind == "wrong_types":
        return _dumps({"model": draw(json_value), "prompt": draw(json_value), "messages": draw(json_value),
                       "stream_options": draw(json_value), "cache_salt": draw(json_value)})
    if kind == "random_json":
        return _dumps(draw(json_value))
    if kind == "invalid_json":
        return draw(st.sampled_from([b"{", b'{"model": "m", "prompt": ', b"nul", b'{"model": NaN}', b"[1,]",
                                     b'{"model": "m"}{"model": "m"}', b'{"model": "\\ud800", "prompt": "x"}']))
    if kind == "binary":
        return draw(st.binary(max_size=400))
    if kind == "deep":
        depth = draw(st.integers(min_value=100, max_value=5000))
        return b'{"model": "m", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == "huge_number":
        digits = draw(st.integers(min_value=20, max_value=5000))
        return b'{"model": "m", "prompt": "p", "max_tokens": ' + b"9" * digits + b", \"x\": 1e999}"
    if kind == "bad_utf8":
        return b'{"model": "m\xff", "prompt": "\xc3\x28 \xed\xa0\x80"}'
    if kind == "empty":
        return draw(st.sampled_from([b"", b"{}", b'{"model": ""}', b'{"model": "m", "prompt": ""}',
                                     b'{"model": "m", "messages": []}']))
    size = draw(st.integers(min_value=100_000, max_value=450_000))  # around both byte limits
    return b'{"model": "m", "prompt": "' + b"a" * size + b'"}'


header_value = st.one_of(st.binary(max_size=40), st.text(max_size=40).map(str.encode),
                         st.sampled_from([b"10.0.0.1", b"10.0.0.2:8000,10.9.9.9", b"\xff\xfe", b"123", b"99999999999"]))


@st.composite
def streams(draw: st.DrawFn, canonical: bool) -> tuple[list[pb.ProcessingRequest], bool]:
    """A message sequence; canonical: headers, body chunks (EoS), a response; else anything goes."""
    body = draw(bodies())
    with_config = draw(st.booleans()) if not canonical else True
    req_mode = draw(st.sampled_from(MODES))
    headers = pb.ProcessingRequest()
    if with_config:
        headers.protocol_config.request_body_mode = req_mode  # type: ignore[assignment]
        headers.protocol_config.response_body_mode = draw(st.sampled_from(MODES))  # type: ignore[assignment]
    hs = headers.request_headers.headers.headers
    for key, value in ((":path", draw(st.sampled_from(PATHS)).encode()), (":method", b"POST")):
        h = hs.add()
        h.key, h.raw_value = key, value
    for key, value in draw(st.lists(st.tuples(st.sampled_from(HEADER_KEYS), header_value), max_size=4)):
        h = hs.add()
        h.key = key
        if draw(st.booleans()):
            h.raw_value = value
        else:
            h.value = value.decode(errors="replace")
    if draw(st.booleans()):
        h = hs.add()
        h.key, h.raw_value = "content-length", str(len(body)).encode()
    bodiless = draw(st.booleans()) and not body
    headers.request_headers.end_of_stream = bodiless
    if draw(st.booleans()):
        sub = headers.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields[
            "x-gateway-destination-endpoint-subset"]
        if draw(st.booleans()):
            for s in draw(st.lists(st.sampled_from(["10.0.0.1:8000", "10.0.0.2", "bogus", ""]), max_size=3)):
                sub.list_value.values.add().string_value = s
        else:
            sub.number_value = 3.0
    msgs = [headers]
    if not bodiless:
        cuts = sorted(draw(st.lists(st.integers(min_value=0, max_value=len(body)), max_size=5)))
        edges = [0, *cuts, len(body)]
        for a, b in itertools.pairwise(edges):
            m = pb.ProcessingRequest()
            m.request_body.body = body[a:b]
            msgs.append(m)
        msgs[-1].request_body.end_of_stream = True
        if draw(st.booleans()):
            msgs[-1].request_body.end_of_stream = False
            t = pb.ProcessingRequest()
            t.request_trailers.SetInParent()
            msgs.append(t)
    rh = pb.ProcessingRequest()
    h = rh.response_headers.headers.headers.add()
    h.key, h.raw_value = ":status", draw(st.sampled_from([b"200", b"500", b"\xff"]))
    rb = pb.ProcessingRequest()
    rb.response_body.body = draw(st.binary(max_size=200))
    rb.response_body.end_of_stream = draw(st.booleans())
    rt = pb.ProcessingRequest()
    rt.response_trailers.SetInParent()
    msgs += [rh, rb, rt]
    if not canonical:
        ops = draw(st.lists(st.tuples(st.sampled_from(["drop", "dup", "swap"]),
                                      st.integers(min_value=0, max_value=len(msgs) - 1)), max_size=4))
        for op, i in ops:
            i %= len(msgs)
            if op == "drop" and len(msgs) > 1:
                msgs.pop(i)
            elif op == "dup":
                msgs.insert(i, msgs[i])
            elif op == "swap" and i + 1 < len(msgs):
                msgs[i], msgs[i + 1] = msgs[i + 1], msgs[i]
        msgs = msgs[:draw(st.integers(min_value=0, max_value=len(msgs)))]  # the stream may end anywhere
        msgs.append(pb.ProcessingRequest())  # an empty message (no oneof set)
    return msgs, canonical and (req_mode in (mode.ProcessingMode.BUFFERED, mode.ProcessingMode.FULL_DUPLEX_STREAMED)
                                or bodiless)


async def _drive(app: App, msgs: Sequence[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    # Each case starts from clean counters, so a leak is reported on the case that caused it.
    for ep in app.datastore.snapshot():
        ep.inflight = ep.inflight_at_scrape = 0
    app.body_budget.used = 0
    proc = StreamProcessor(app.director, app.metrics, True, app.body_budget)

    async def gen() -> AsyncIterator[pb.ProcessingRequest]:
        for m in msgs:
            yield m

    return [r async for r in proc.run(gen())]


def _check(app: App, out: list[pb.ProcessingResponse]) -> None:
    for i, resp in enumerate(out):
        kind = resp.WhichOneof("response")
        assert kind is not None
        pb.ProcessingResponse.FromString(resp.SerializeToString())
        if kind == "immediate_response":
            assert i == len(out) - 1, "an ImmediateResponse must end the stream"
            imm = resp.immediate_response
            assert imm.status.code in STATUSES
            err = orjson.loads(imm.body)["error"]
            assert err["code"] == imm.status.code and err["message"] and err["type"]
            assert imm.status.code != 500 or "does not support" in err["message"], err  # no internal faults
    assert all(ep.inflight == 0 for ep in app.datastore.snapshot())
    assert app.body_budget.used == 0


@FUZZ
@given(case=streams(canonical=True))
def test_complete_requests_always_get_an_answer(app: App, loop: asyncio.AbstractEventLoop,
                                                case: tuple[list[pb.ProcessingRequest], bool]) -> None:
    msgs, must_answer = case
    out = loop.run_until_complete(_drive(app, msgs))
    _check(app, out)
    if must_answer:
        kinds = [r.WhichOneof("response") for r in out]
        routed = any((r.HasField("request_headers") and r.request_headers.response.header_mutation.set_headers)
                     or (r.HasField("request_body") and r.request_body.response.header_mutation.set_headers)
                     for r in out)
        assert routed or kinds[-1] == "immediate_response", kinds


@FUZZ
@given(case=streams(canonical=False))
def test_any_message_order_ends_cleanly(app: App, loop: asyncio.AbstractEventLoop,
                                        case: tuple[list[pb.ProcessingRequest], bool]) -> None:
    out = loop.run_until_complete(_drive(app, case[0]))
    _check(app, out)
