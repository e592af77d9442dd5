"""/v1/messages as the chat request vLLM converts it to: system, tools, blocks; cache_control left out."""

from __future__ import annotations

import itertools
import random
from typing import Any

import orjson
import pytest

from extproc.core.errors import EppError
from extproc.request.messages import to_chat
from extproc.request.openai import Api, parse_request

SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=9f3a;"},
          {"type": "text", "text": "You are a coding agent. ", "cache_control": {"type": "ephemeral"}},
          {"type": "text", "text": "Follow the repository's rules."}]
TOOLS = [{"name": "read_file", "description": "Read a file", "input_schema": {"type": "object"}}]


def _body(messages: list[Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 64, "system": SYSTEM, "tools": TOOLS, "messages": messages, **extra}


def _turns(n: int) -> list[Any]:
    """An agent's conversation after n tool round trips; the breakpoint sits on the newest block."""
    messages: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "fix the bug"}]}]
    for i in range(n):
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": f"reading {i}"},
            {"type": "tool_use", "id": f"toolu_{i}", "name": "read_file", "input": {"path": f"f{i}.py"}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": f"contents of f{i}"}]})
    last = messages[-1]["content"][-1]
    last["cache_control"] = {"type": "ephemeral"}
    return messages


def test_conversion_follows_vllm() -> None:
    messages, tools = to_chat(_body(_turns(1)))
    assert messages[0] == {"role": "system", "content": "You are a coding agent. Follow the repository's rules."}
    assert messages[1] == {"role": "user", "content": "fix the bug"}
    assert messages[2]["role"] == "assistant" and messages[2]["content"] == "reading 0"
    assert messages[2]["tool_calls"] == [{"id": "toolu_0", "type": "function", "function": {
        "name": "read_file", "arguments": '{"path":"f0.py"}'}}]
    # A user's tool_result becomes a tool message; the user message left empty is dropped.
    assert messages[3] == {"role": "tool", "tool_call_id": "toolu_0", "content": "contents of f0"}
    assert len(messages) == 4
    assert tools == [{"type": "function", "function": {
        "name": "read_file", "description": "Read a file", "parameters": {"type": "object"}}}]


def test_an_agents_turns_extend_each_other_though_the_breakpoint_moves() -> None:
    segments = [parse_request(Api.MESSAGES, orjson.dumps(_body(_turns(n)))).segments for n in range(1, 5)]
    for earlier, later in itertools.pairwise(segments):
        assert later[: len(earlier)] == earlier
    assert segments[0][0].startswith(b"system\x1fYou are a coding agent.")
    assert segments[0][1].startswith(b"tools\x1f")
    assert not any(b"cache_control" in s or b"billing" in s for s in segments[-1])


def test_same_conversation_as_chat_shares_the_prefix() -> None:
    msgs = parse_request(Api.MESSAGES, orjson.dumps(_body(_turns(2))))
    chat_messages, chat_tools = to_chat(_body(_turns(2)))
    chat = parse_request(Api.CHAT, orjson.dumps({"model": "m", "messages": chat_messages, "tools": chat_tools}))
    assert msgs.segments == chat.segments
    assert msgs.chat is not None and msgs.chat[0] == chat_messages and msgs.tools == chat_tools


def test_system_string_and_images_in_tool_results() -> None:
    png = "iVBORw0KGgo="
    messages, tools = to_chat({"model": "m", "system": "be brief", "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]},
            {"type": "text", "text": "what is it?"}]}]})
    assert tools is None
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "tool", "tool_call_id": "t", "content": "a\nb"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}]},
        {"role": "user", "content": "what is it?"},
    ]


@pytest.mark.parametrize(("body", "needle"), [
    ({"model": "m", "messages": []}, "'messages' must be a non-empty list"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "message 'content'"),
    ({"model": "m", "messages": [{"role": "user", "content": [7]}]}, "content block"),
    ({"model": "m", "system": 3, "messages": [{"role": "user", "content": "x"}]}, "'system'"),
    ({"model": "m", "tools": {}, "messages": [{"role": "user", "content": "x"}]}, "'tools' must be a list"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image", "source": "x"}]}]}, "'source'"),
])
def test_malformed_messages_are_bad_requests(body: dict[str, Any], needle: str) -> None:
    with pytest.raises(EppError) as info:
        parse_request(Api.MESSAGES, orjson.dumps(body))
    assert info.value.http_status == 400 and needle in info.value.message


def _junk(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["str", "int", "none", "bool", "float"] + (["list", "dict", "block"] if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "list":
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == "dict":
        return {rng.choice(["type", "text", "source", "content", "role", "input", "id"]): _junk(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    if kind == "block":
        return {"type": rng.choice(["text", "image", "tool_use", "tool_result", "thinking", "x"]),
                **{k: _junk(rng, depth + 1) for k in rng.sample(["text", "source", "content", "input", "id",
                                                                 "name", "tool_use_id", "thinking"], 3)}}
    return {"str": "s", "int": 7, "none": None, "bool": True, "float": 1.5}[kind]


def test_any_malformed_body_is_a_clear_400_never_a_crash() -> None:
    """Random blocks, parts and fields (images without sources, tool results of any type, ...)."""
    rng = random.Random(28)
    for _ in range(3000):
        body = {"model": "m", "messages": [{"role": rng.choice(["user", "assistant", "system", 5]),
                                            "content": _junk(rng)} for _ in range(rng.randrange(1, 4))]}
        for key in ("system", "tools"):
            if rng.random() < 0.5:
                body[key] = _junk(rng)
        for api in (Api.MESSAGES, Api.CHAT, Api.RESPONSES):
            if api is Api.RESPONSES:
                body["input"] = body["messages"]
            try:
                parse_request(api, orjson.dumps(body))
            except EppError as err:
                assert err.http_status == 400
