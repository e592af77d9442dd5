"""The simulator serves /v1/messages and /v1/responses as the chat request vLLM renders."""

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


@pytest.mark.parametrize(("body", "shape"), [
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "input": "x", "previous_response_id": "resp_1"}, "responses"),
    ({"model": "m", "input": 5}, "responses"),
])
def test_what_cannot_be_served_is_a_bad_request(body: dict[str, object], shape: str) -> None:
    with pytest.raises(ApiError):
        as_chat(body, shape)
