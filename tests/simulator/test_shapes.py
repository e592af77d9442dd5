"""The simulator converts /v1/messages and /v1/responses requests into the chat request vLLM renders."""

from __future__ import annotations

import pytest

from extproc.request.messages import to_chat
from prefix_epp_sim.openai_api import ApiError
from prefix_epp_sim.shapes import as_chat


def test_messages_and_responses_become_the_chat_request() -> None:
    body = {"model": "m", "max_tokens": 3, "stream": True, "system": "S",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "U"}]}]}
    assert as_chat(body, "messages") == {"model": "m", "max_tokens": 3, "stream": True,
                                         "messages": to_chat(body)[0]}
    responses = {"model": "m", "instructions": "S", "max_output_tokens": 5, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "U"}]}]}
    assert as_chat(responses, "responses") == {"model": "m", "max_tokens": 5, "messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]}


def test_a_responses_history_goes_between_the_instructions_and_the_input() -> None:
    history = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "answer"}]
    body = {"model": "m", "instructions": "S", "input": "second", "previous_response_id": "resp_1"}
    assert as_chat(body, "responses", history)["messages"] == [
        {"role": "system", "content": "S"}, *history, {"role": "user", "content": "second"}]


@pytest.mark.parametrize(("body", "shape"), [
    ({"model": "m", "max_tokens": 4, "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "messages"),  # max_tokens is required
    ({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"model": "m", "input": 5}, "responses"),
    ({"model": "m", "input": [{"content": "no role"}]}, "responses"),
])
def test_what_cannot_be_served_is_a_bad_request(body: dict[str, object], shape: str) -> None:
    with pytest.raises(ApiError) as err:
        as_chat(body, shape)
    assert err.value.status == 400
