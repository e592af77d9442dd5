"""`mixed-shapes`: one workload in every request shape the picker parses (bench.lib.workloads).

Conversations of `turns` turns in five shapes, dealt in turn: completions (each turn's prompt is
the system prompt and the user turns so far, one string), chat (with tools), Anthropic Messages
(system as text blocks with a `cache_control` breakpoint that moves to the newest block each
turn, the tools in Anthropic form), Responses (instructions and the full input, as a client with
`store: false` sends it, so no turn depends on a replica's response store) and chat with an image (a
base64 PNG-like data URL in the first user message; conversations of one group share their
group's image, as a team shares a screenshot). Each conversation uses one of `system_prompts`
shared system prompts (`system_tokens`), its first user message carries `first_user_tokens`, later
ones `user_tokens`; the history includes the previous answers. Starts at `rate` per second,
think time exponential with mean `think_s`. The simulator computes Messages and Responses prompts as
the chat request vLLM renders (prefix_epp_sim/shapes.py), so the oracle tokenizes them that way.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

SHAPES = ("completion_turns", "chat_tools", "messages", "responses", "chat_image")  # Session.api values
SHAPE_PATHS: Mapping[str, str] = {"completion_turns": "/v1/completions", "chat_tools": "/v1/chat/completions",
                                  "messages": "/v1/messages", "responses": "/v1/responses",
                                  "chat_image": "/v1/chat/completions"}
CHAT_TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "search", "description": "search the manual", "parameters": {"type": "object"}}}]
ANTHROPIC_TOOLS = [{"name": "search", "description": "search the manual", "input_schema": {"type": "object"}}]
IMAGE_BYTES = 48 * 1024


@dataclass(frozen=True)
class MixedShapesParams:
    conversations: int = 60
    turns: int = 4
    system_prompts: int = 6
    system_tokens: int = 1500
    first_user_tokens: int = 1500
    user_tokens: int = 300
    max_tokens: int = 32
    rate: float = 3.0  # conversation starts per second
    think_s: float = 1.0
    seed: int = 0


def image_url(system: str) -> str:
    """The group's image: seeded bytes from its system prompt, as a data URL."""
    rng = random.Random(xxhash.xxh64_intdigest(system.encode()))
    return "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + rng.randbytes(IMAGE_BYTES)).decode()


def shaped_body(api: str, system: str, prompts: Sequence[str], turn: int, answers: Sequence[str],
                common: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(path, body) of a conversation's turn in its shape."""
    path = SHAPE_PATHS[api]
    users = list(prompts[:turn + 1])
    if api == "completion_turns":
        return path, {**common, "prompt": system + "".join(f"\nUser: {u}" for u in users)}
    if api == "responses":
        items: list[dict[str, Any]] = []
        for k, u in enumerate(users):
            items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": u}]})
            if k < turn:
                items.append({"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": answers[k]}]})
        return path, {**common, "instructions": system, "input": items, "tools": [
            {"type": "function", **CHAT_TOOLS[0]["function"]}]}
    if api == "messages":
        msgs: list[dict[str, Any]] = []
        for k, u in enumerate(users):
            msgs.append({"role": "user", "content": [{"type": "text", "text": u}]})
            if k < turn:
                msgs.append({"role": "assistant", "content": [{"type": "text", "text": answers[k]}]})
        msgs[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        return path, {**common, "tools": ANTHROPIC_TOOLS, "messages": msgs,
                      "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]}
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for k, u in enumerate(users):
        content: Any = u
        if api == "chat_image" and k == 0:
            content = [{"type": "image_url", "image_url": {"url": image_url(system)}}, {"type": "text", "text": u}]
        messages.append({"role": "user", "content": content})
        if k < turn:
            messages.append({"role": "assistant", "content": answers[k]})
    extra = {"tools": CHAT_TOOLS} if api == "chat_tools" else {}
    return path, {**common, "messages": messages, **extra}


def mixed_shapes(p: MixedShapesParams = MixedShapesParams()) -> Workload:
    rng = random.Random(f"mixed-shapes:{p.seed}")
    systems = [text(rng, p.system_tokens, f"You are assistant number {a}.") for a in range(p.system_prompts)]
    starts = poisson_starts(rng, p.conversations, p.rate)
    sessions = []
    for c in range(p.conversations):
        api = SHAPES[c % len(SHAPES)]
        prompts = tuple(text(rng, p.first_user_tokens if t == 0 else p.user_tokens, f"Conversation {c}, turn {t}:")
                        for t in range(p.turns))
        think = tuple(rng.expovariate(1.0 / p.think_s) for _ in range(p.turns - 1))
        sessions.append(Session(c, starts[c], api, prompts, p.max_tokens,  # type: ignore[arg-type]
                                system=rng.choice(systems), think_s=think, label=f"{api}{c}"))
    return Workload("mixed-shapes", tuple(sessions), vars(p))


from bench.lib.workloads import Session, Workload, poisson_starts, text  # noqa: E402  (workloads.body imports this module)
