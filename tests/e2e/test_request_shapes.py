"""Every request shape routes by prefix through real Envoy: completions, chat, Anthropic Messages,
Responses (with `previous_response_id` chains), images; unknown paths pass, routed by load.

Each test runs groups of conversations, each group sharing a long system prompt: a group's
follow-up turns keep its first turn's endpoint. The first turns are placed on the three backends
in turn (the conformance header), so the groups start apart by construction and landing together
is the prefix's doing: the echo backends export no load, and the picker's prediction for a new
prompt on an idle pool differs between them only by a fraction of a millisecond, so left to
itself it may put every group on the one it measured fastest.
"""

from __future__ import annotations

import base64
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from testkit.http_client import post
from testkit.picker import scrape, value
from testkit.stack import Stack

pytestmark = pytest.mark.e2e

GROUPS = 6
TURNS = 4


def _system(group: int) -> str:
    rng = random.Random(group)
    return f"group {group}: " + " ".join("".join(rng.choice("abcdefghij") for _ in range(6)) for _ in range(300))


def _completions(group: int, turn: int) -> tuple[str, dict[str, Any]]:
    history = "".join(f"\nQ{t}: question {t}?\nA{t}: answer {t}." for t in range(turn))
    return "/v1/completions", {"model": "m", "max_tokens": 4, "prompt": _system(group) + history + f"\nQ{turn}:"}


def _chat(group: int, turn: int) -> tuple[str, dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": _system(group)}]
    for t in range(turn + 1):
        messages.append({"role": "user", "content": f"question {t}"})
        if t < turn:
            messages.append({"role": "assistant", "content": f"answer {t}"})
    return "/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": messages,
                                    "tools": [{"type": "function", "function": {"name": "grep"}}]}


def _messages(group: int, turn: int) -> tuple[str, dict[str, Any]]:
    """A coding agent: system blocks with a moving cache breakpoint, tools, tool round trips."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "fix the bug"}]}]
    for t in range(turn):
        messages.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": f"toolu_{t}", "name": "read", "input": {"path": f"f{t}.py"}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{t}", "content": f"source of f{t}.py"}]})
    messages[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return "/v1/messages", {
        "model": "m", "max_tokens": 4, "messages": messages,
        "system": [{"type": "text", "text": f"x-anthropic-billing-header: cch={random.random()};"},
                   {"type": "text", "text": _system(group), "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "read", "description": "read a file", "input_schema": {"type": "object"}}]}


def _responses(group: int, turn: int) -> tuple[str, dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for t in range(turn + 1):
        items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"q {t}"}]})
        if t < turn:
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": f"a {t}"}]})
    return "/v1/responses", {"model": "m", "instructions": _system(group), "input": items}


def _image_chat(group: int, turn: int) -> tuple[str, dict[str, Any]]:
    image = base64.b64encode(random.Random(group).randbytes(300_000)).decode()
    messages: list[dict[str, Any]] = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
        {"type": "text", "text": "describe the picture"}]}]
    for t in range(turn):
        messages += [{"role": "assistant", "content": f"answer {t}"}, {"role": "user", "content": f"more {t}"}]
    return "/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": messages}


SHAPES: dict[str, Callable[[int, int], tuple[str, dict[str, Any]]]] = {
    "completions": _completions, "chat": _chat, "messages": _messages, "responses": _responses,
    "image_chat": _image_chat,
}


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_groups_turns_land_on_one_endpoint_for_every_shape(default_stack: Stack, shape: str) -> None:
    make = SHAPES[shape]
    backends = default_stack.backends
    async with aiohttp.ClientSession() as s:
        for group in range(GROUPS):
            home = backends[group % len(backends)]
            first = {"test-epp-endpoint-selection": home}
            served = []
            for turn in range(TURNS):
                path, body = make(group, turn)
                r = await post(s, f"{default_stack.url}{path}", body, headers=None if turn else first)
                assert r.status == 200, r.body[:300]
                served.append(r.served_by)
            assert served == [home] * TURNS, (shape, group, served)


async def test_messages_and_the_same_chat_conversation_share_their_endpoint(default_stack: Stack) -> None:
    """vLLM renders /v1/messages as the chat request it converts it to: the picker hashes it so."""
    async with aiohttp.ClientSession() as s:
        for group in range(100, 100 + GROUPS):
            system = _system(group)
            r1 = await post(s, f"{default_stack.url}/v1/messages", {
                "model": "m", "max_tokens": 4, "system": system, "messages": [{"role": "user", "content": "hi"}]})
            r2 = await post(s, f"{default_stack.url}/v1/chat/completions", {
                "model": "m", "max_tokens": 4,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi again"}]})
            assert r1.status == r2.status == 200
            assert r1.served_by == r2.served_by, group


async def test_previous_response_id_follows_the_chain_to_its_endpoint(default_stack: Stack) -> None:
    """Turns that share no text at all: only the response ids tie them to the first turn's endpoint.
    Each chain's first turn is placed on a chosen backend (the conformance header), in turn, so the
    chains start apart by construction and every later turn, sent without it, must follow its id."""
    rng = random.Random(11)
    homes = Counter[str]()
    url = f"{default_stack.url}/v1/responses"
    async with aiohttp.ClientSession() as s:
        for chain in range(8):
            previous = ""
            served = []
            for turn in range(TURNS):
                text = f"{chain}/{turn} " + "".join(rng.choice("abcdefgh ") for _ in range(400))
                body: dict[str, Any] = {"model": "m", "input": text, "stream": turn % 2 == 1}
                if previous:
                    body["previous_response_id"] = previous
                first = {"test-epp-endpoint-selection": default_stack.backends[chain % len(default_stack.backends)]}
                r = await post(s, url, body, headers=None if previous else first)
                assert r.status == 200
                served.append(r.served_by)
                previous = (r.json()["id"] if not body["stream"] else
                            r.body.split(b'"id": "', 1)[1].split(b'"', 1)[0].decode())
                assert previous.startswith("resp_")
            assert len(set(served)) == 1, (chain, served)
            homes[served[0]] += 1
    assert set(homes) == set(default_stack.backends), homes
    samples = scrape(default_stack.picker)
    hits = value(samples, "prefix_epp_affinity_requests_total", source="previous_response_id", hit="true")
    assert hits >= 8 * (TURNS - 1)


async def test_unknown_paths_pass_routed_by_load_and_are_counted(default_stack: Stack) -> None:
    before = value(scrape(default_stack.picker), "prefix_epp_request_shapes_total", api="other")
    async with aiohttp.ClientSession() as s:
        replies = [await post(s, f"{default_stack.url}/v1/audio/transcriptions", raw=b"\x00binary, not JSON")
                   for _ in range(3)]
        replies.append(await post(s, f"{default_stack.url}/v1/messages/count_tokens",
                                  {"messages": [{"role": "user", "content": "x"}]}))  # no model: still passes
    assert all(r.status == 200 and r.served_by in default_stack.backends for r in replies)
    after = value(scrape(default_stack.picker), "prefix_epp_request_shapes_total", api="other")
    assert after - before == 4
    assert value(scrape(default_stack.picker), "prefix_epp_request_shapes_total", api="messages") >= 1
