"""The session header reaches the director through the ext_proc headers phase; the key stays private."""

from __future__ import annotations

import orjson
import pytest
from prometheus_client import generate_latest

from extproc.config.settings import AffinityConfig
from extproc.pb import external_processor_pb2 as pb
from extproc.runtime.app import App
from extproc.transport.processor import EXPLAIN_HEADER
from testkit.extproc_stream import body_msgs, destination, drive, error_body, headers_msg, make_app


def counted(app: App, source: str, hit: bool) -> float:
    value = app.metrics.registry.get_sample_value(
        "prefix_epp_affinity_requests_total", {"source": source, "hit": str(hit).lower()})
    return float(value or 0.0)


def chat(text: str, **extra: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}], **extra})


def response_headers() -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    h = msg.response_headers.headers.headers.add()
    h.key, h.raw_value = ":status", b"200"
    return msg


async def test_session_header_keeps_a_conversation_on_its_endpoint(caplog: pytest.LogCaptureFixture) -> None:
    app = make_app(4, scheduler="weighted")  # the weighted rule: a key holder wins equal loads
    secret = "session-7f3a-private"
    session = [("x-session-id", secret)]
    path = "/v1/chat/completions"
    with caplog.at_level("DEBUG"):
        first = await drive(app, [headers_msg(path, extra=session), *body_msgs(chat("q" * 300))])
        for i in range(5):  # prompts that share nothing with the first
            out = await drive(app, [headers_msg(path, extra=session), *body_msgs(chat(f"{i}" * 300)),
                                    response_headers()], explain=True)
            assert destination(out[0]) == destination(first[0])
            explained = out[-1].response_headers.response.header_mutation.set_headers[0].header
            assert explained.key == EXPLAIN_HEADER and b"affinity=hit" in explained.raw_value
            assert secret.encode() not in explained.raw_value
    assert counted(app, "session_header", False) == 1 and counted(app, "session_header", True) == 5
    assert all(secret not in r.getMessage() and secret not in str(r.__dict__) for r in caplog.records)
    assert secret.encode() not in generate_latest(app.metrics.registry)


async def test_prompt_cache_key_wins_and_the_header_name_is_configurable() -> None:
    app = make_app(3, affinity=AffinityConfig(session_header="x-conversation"))
    msgs = [headers_msg(extra=[("x-conversation", "c-1"), ("x-session-id", "ignored")]),
            *body_msgs(orjson.dumps({"model": "m", "prompt": "p" * 200, "prompt_cache_key": "k-1"}))]
    await drive(app, msgs)
    assert counted(app, "prompt_cache_key", False) == 1 and counted(app, "session_header", False) == 0
    await drive(app, [headers_msg(extra=[("x-session-id", "s")]), *body_msgs(orjson.dumps(
        {"model": "m", "prompt": "p" * 200}))])
    assert counted(app, "session_header", False) == 0  # not the configured header
    await drive(app, [headers_msg(extra=[("x-conversation", "c-1")]), *body_msgs(orjson.dumps(
        {"model": "m", "prompt": "p" * 200}))])
    assert counted(app, "session_header", False) == 1


async def test_switched_off_reads_no_header() -> None:
    app = make_app(3, affinity=AffinityConfig(enabled=False))
    out = await drive(app, [headers_msg(extra=[("x-session-id", "s")]), *body_msgs(orjson.dumps(
        {"model": "m", "prompt": "p" * 200, "prompt_cache_key": "k"})), response_headers()], explain=True)
    assert b"affinity" not in out[-1].response_headers.response.header_mutation.set_headers[0].header.raw_value
    assert counted(app, "prompt_cache_key", False) == counted(app, "session_header", False) == 0


async def test_bad_prompt_cache_key_and_non_utf8_session_header_are_400() -> None:
    app = make_app()
    out = await drive(app, [headers_msg(), *body_msgs(orjson.dumps({"model": "m", "prompt": "p",
                                                                     "prompt_cache_key": 12}))])
    assert out[0].immediate_response.status.code == 400
    assert error_body(out[0].immediate_response)["message"] == "'prompt_cache_key' must be a string"
    msg = headers_msg()
    h = msg.request_headers.headers.headers.add()
    h.key, h.raw_value = "x-session-id", b"\xff\xfe"
    out = await drive(app, [msg, *body_msgs(orjson.dumps({"model": "m", "prompt": "p"}))])
    assert out[0].immediate_response.status.code == 400
    assert error_body(out[0].immediate_response)["message"] == "header x-session-id is not valid UTF-8"
