from __future__ import annotations

import orjson
import pytest

from extproc.core.errors import EppError, ErrorCode
from extproc.request.openai import Api, api_from_path, parse_request


@pytest.mark.parametrize(("path", "api"), [
    ("/v1/completions", Api.COMPLETIONS),
    ("/v1/chat/completions", Api.CHAT),
    ("/v1/chat/completions?x=1", Api.CHAT),
    ("/v1/responses", Api.RESPONSES),
    ("/v1/embeddings", Api.EMBEDDINGS),
    ("/v1/models", Api.OTHER),
])
def test_api_from_path(path: str, api: Api) -> None:
    assert api_from_path(path) is api


@pytest.mark.parametrize(("raw", "needle"), [
    (b'{"model":', "not valid JSON"),
    (b"[1,2]", "JSON object"),
    (b'"text"', "JSON object"),
    (b'{"prompt":"hi"}', "model not found"),
    (b'{"model":"","prompt":"hi"}', "model not found"),
    (b'{"model":7,"prompt":"hi"}', "model not found"),
])
def test_invalid_bodies_are_bad_requests(raw: bytes, needle: str) -> None:
    with pytest.raises(EppError) as info:
        parse_request(Api.COMPLETIONS, raw)
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert info.value.http_status == 400
    assert needle in info.value.message


def test_chat_requires_messages() -> None:
    with pytest.raises(EppError):
        parse_request(Api.CHAT, b'{"model":"m","messages":[]}')


def test_completions_prompt_forms() -> None:
    assert parse_request(Api.COMPLETIONS, b'{"model":"m","prompt":"abc"}').segments == [b"abc"]
    assert parse_request(Api.COMPLETIONS, b'{"model":"m","prompt":["a","b"]}').segments == [b"a b"]
    tokens = parse_request(Api.COMPLETIONS, b'{"model":"m","prompt":[1,2,3]}')
    assert tokens.segments == [b"[1,2,3]"]


def test_chat_segments_are_canonical_per_message() -> None:
    a = parse_request(Api.CHAT, orjson.dumps({"model": "m", "messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}))
    b = parse_request(Api.CHAT, b'{ "messages" : [ {"content":"S","role":"system"},'
                                b' {"content":[{"type":"text","text":"U"}],"role":"user"} ], "model":"m"}')
    assert a.segments == b.segments == [b"system\x1fS", b"user\x1fU"]


def test_later_turn_extends_earlier_turn() -> None:
    turn1 = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"}]
    turn2 = [*turn1, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    s1 = parse_request(Api.CHAT, orjson.dumps({"model": "m", "messages": turn1})).segments
    s2 = parse_request(Api.CHAT, orjson.dumps({"model": "m", "messages": turn2})).segments
    assert s2[: len(s1)] == s1


def test_images_change_segments() -> None:
    def body(url: str) -> bytes:
        return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": url}}]}]})
    assert parse_request(Api.CHAT, body("http://a/1.png")).segments != parse_request(Api.CHAT, body("http://a/2.png")).segments


def test_tools_come_first_and_stream_flags() -> None:
    p = parse_request(Api.CHAT, orjson.dumps({
        "model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}],
        "stream": True, "stream_options": {"include_usage": True}, "cache_salt": "tenant-1"}))
    assert p.segments[0].startswith(b"tools\x1f")
    assert p.stream and p.include_usage and p.cache_salt == "tenant-1"


def test_system_then_tools_then_turns_in_every_shape() -> None:
    """The engine's prompt order; one canonical tool form, so the shapes share their prefix."""
    params = {"type": "object", "properties": {"q": {"type": "string"}}}
    chat = parse_request(Api.CHAT, orjson.dumps({"model": "m", "messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": params}}]}))
    responses = parse_request(Api.RESPONSES, orjson.dumps({"model": "m", "instructions": "S", "input": [
        {"type": "message", "role": "user", "content": "U"}],
        "tools": [{"type": "function", "name": "f", "description": "d", "parameters": params}]}))
    messages = parse_request(Api.MESSAGES, orjson.dumps({"model": "m", "system": "S", "max_tokens": 5,
        "messages": [{"role": "user", "content": "U"}],
        "tools": [{"name": "f", "description": "d", "input_schema": params}]}))
    assert chat.segments[0] == b"system\x1fS" and chat.segments[1].startswith(b"tools\x1f")
    assert chat.segments == responses.segments == messages.segments


def test_unknown_paths_are_load_only_and_never_refused() -> None:
    for raw in (b'{"model": "m", "prompt": "hi"}', b"not json at all", b"", b'{"no": "model"}'):
        p = parse_request(Api.OTHER, raw)
        assert p.segments == [] and p.api is Api.OTHER
    assert parse_request(Api.OTHER, b'{"model": "m"}').model == "m"
    assert api_from_path("/v1/messages/count_tokens") is Api.OTHER
    assert api_from_path("/v1/chat/completions/render") is Api.OTHER
    assert api_from_path("/v1/messages") is Api.MESSAGES


def test_previous_response_id_is_read_and_checked() -> None:
    p = parse_request(Api.RESPONSES, b'{"model": "m", "input": "x", "previous_response_id": "resp_1"}')
    assert p.previous_response_id == "resp_1"
    with pytest.raises(EppError) as info:
        parse_request(Api.RESPONSES, b'{"model": "m", "input": "x", "previous_response_id": 7}')
    assert "'previous_response_id' must be a string" in info.value.message


def test_responses_api() -> None:
    p = parse_request(Api.RESPONSES, orjson.dumps({"model": "m", "instructions": "be brief", "input": "hello"}))
    assert p.segments == [b"system\x1fbe brief", b"user\x1fhello"]  # instructions: the system message
    items = parse_request(Api.RESPONSES, orjson.dumps({"model": "m", "input": [{"role": "user", "content": "a"}]}))
    assert items.segments == [b"user\x1fa"]


def test_deeply_nested_prompt_is_a_bad_request_not_a_crash() -> None:
    deep = b'{"model": "m", "prompt": ' + b"[" * 300 + b"]" * 300 + b"}"
    with pytest.raises(EppError) as info:
        parse_request(Api.COMPLETIONS, deep)
    assert info.value.code is ErrorCode.BAD_REQUEST and "nested too deeply" in info.value.message
