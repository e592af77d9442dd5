"""The official openai and anthropic SDKs against the quick-start stack: `prefix-epp sim` replicas,
the picker (`prefix-epp serve`) and real Envoy configured by `prefix-epp envoy-config`.

Every shape the picker routes, streamed and not, parsed by the SDK a user would use: completions,
chat completions, Responses (and a `previous_response_id` chain, which only the replica that
stored the previous response can serve: the picker must route each turn there), embeddings
(the openai SDK asks for base64 unless told otherwise) and Anthropic Messages (the stream read
through the SDK's helpers). The picker reads every response's usage (`--usage-sample-rate 1`),
so its served hit rate counts each shape's own way of reporting cached tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import anthropic
import openai
import pytest

from prefix_epp_sim.embeddings import DIMENSIONS
from testkit.envoy import run_envoy
from testkit.picker import Picker, picker_for, scrape, value
from testkit.procs import consecutive_free_ports, prefix_epp, running, wait_for_port

pytestmark = pytest.mark.e2e

REPLICAS = 3
MODEL = "sim-model"


def system(desk: str) -> str:
    """A system prompt of its own per test (the stack, and so its caches, outlive each test)."""
    return f"You are the {desk} desk of a bicycle shop; answer from the manual. " * 12

TEXT = "The quick brown fox jumps over a lazy dog"  # the simulator's answer: 9 tokens


@dataclass(frozen=True)
class Gateway:
    url: str  # Envoy's base URL
    picker: Picker


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Envoy in front of the picker and REPLICAS simulated replicas."""
    tmp = tmp_path_factory.mktemp("sdks")
    base = consecutive_free_ports(REPLICAS)
    sim = prefix_epp("sim", "--replicas", str(REPLICAS), "--port", str(base), "--host", "127.0.0.1",
                     "--time-scale", "20", "--no-kv-events", "--default-max-tokens", "9")
    with running(sim, tmp / "sim.log", wait_port=base + REPLICAS - 1):
        for i in range(REPLICAS):
            wait_for_port(base + i)
        picker = picker_for(tmp, [f"127.0.0.1:{base + i}" for i in range(REPLICAS)], "--usage-sample-rate", "1")
        picker.start()
        try:
            with run_envoy(tmp, picker.grpc_port) as (_, listen, _admin):
                yield Gateway(f"http://127.0.0.1:{listen}", picker)
        finally:
            picker.stop()


def served(picker: Picker) -> tuple[float, float]:
    """(prompt, cached) tokens of the responses the picker has read, once no stream is open (each
    response's usage is counted at its end, which can come after the client has its reply)."""
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(picker)
        if value(samples, "prefix_epp_open_streams") == 0 or time.monotonic() > deadline:
            return (value(samples, "prefix_epp_served_prompt_tokens_total"),
                    value(samples, "prefix_epp_served_cached_prompt_tokens_total"))
        time.sleep(0.05)


@pytest.fixture
def oai(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def claude(gateway: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0)


def test_completions_and_chat(oai: openai.OpenAI) -> None:
    system_prompt = system("chat")
    done = oai.completions.create(model=MODEL, prompt=system_prompt, max_tokens=9)
    assert done.choices[0].text == TEXT and done.usage is not None and done.usage.completion_tokens == 9
    streamed = oai.completions.create(model=MODEL, prompt=system_prompt, max_tokens=9, stream=True)
    pieces = [c.choices[0].text for c in streamed if c.choices]
    assert "".join(pieces) == TEXT
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "system", "content": system_prompt}, {"role": "user", "content": "My chain skips."}]
    chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=9)
    assert chat.choices[0].message.content == TEXT and chat.usage is not None
    assert chat.usage.prompt_tokens_details is not None and chat.usage.prompt_tokens_details.cached_tokens is not None
    stream = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TEXT
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == chat.usage.prompt_tokens and usage.completion_tokens == 9
    # The second identical conversation lands where the first one's blocks are.
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens
    assert usage.prompt_tokens_details.cached_tokens >= chat.usage.prompt_tokens // 2


def test_responses_and_a_previous_response_id_chain(oai: openai.OpenAI, gateway: Gateway) -> None:
    before = served(gateway.picker)
    system_prompt = system("responses")
    first = oai.responses.create(model=MODEL, instructions=system_prompt, input="My chain skips.", max_output_tokens=9)
    assert first.id.startswith("resp_") and first.output_text == TEXT
    assert first.usage is not None and first.usage.output_tokens == 9 and first.usage.input_tokens > 0
    assert first.usage.input_tokens_details.cached_tokens == 0  # a prompt no replica saw before
    previous, usages = first, [first.usage]
    for turn in range(4):  # each turn continues the one before: only its replica holds it
        nxt = oai.responses.create(model=MODEL, instructions=system_prompt, input=f"Still skips ({turn}).",
                                   previous_response_id=previous.id, max_output_tokens=9)
        assert nxt.output_text == TEXT and nxt.previous_response_id == previous.id
        assert nxt.usage is not None and previous.usage is not None
        assert nxt.usage.input_tokens > previous.usage.input_tokens  # the history came along
        assert nxt.usage.input_tokens_details.cached_tokens >= previous.usage.input_tokens // 2
        previous = nxt
        usages.append(nxt.usage)
    with oai.responses.stream(model=MODEL, instructions=system_prompt, input="And the brakes?",
                              previous_response_id=previous.id, max_output_tokens=9) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == TEXT
    assert final.usage is not None and final.usage.input_tokens_details.cached_tokens > 0
    usages.append(final.usage)
    after = served(gateway.picker)  # counted from Responses' own usage shape
    assert (after[0] - before[0], after[1] - before[1]) == (sum(u.input_tokens for u in usages),
                                                          sum(u.input_tokens_details.cached_tokens for u in usages))


def test_embeddings_float_and_the_sdks_default_base64(oai: openai.OpenAI) -> None:
    default = oai.embeddings.create(model=MODEL, input=["brake pads", "chain oil"])  # sends base64
    floats = oai.embeddings.create(model=MODEL, input=["brake pads", "chain oil"], encoding_format="float")
    assert [len(d.embedding) for d in default.data] == [DIMENSIONS, DIMENSIONS]
    for a, b in zip(default.data, floats.data, strict=True):
        assert a.index == b.index and a.embedding == pytest.approx(b.embedding)
    assert default.usage.prompt_tokens == floats.usage.prompt_tokens == default.usage.total_tokens > 0
    one = oai.embeddings.create(model=MODEL, input="brake pads", encoding_format="float")
    assert one.data[0].embedding == floats.data[0].embedding


def test_anthropic_messages(claude: anthropic.Anthropic, gateway: Gateway) -> None:
    before = served(gateway.picker)
    system_prompt = system("messages")
    messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": "My chain skips."}]
    message = claude.messages.create(model=MODEL, max_tokens=9, system=system_prompt, messages=messages)
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == TEXT  # type: ignore[union-attr]
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 9
    assert message.usage.cache_read_input_tokens == 0 and message.usage.input_tokens > 0
    with claude.messages.stream(model=MODEL, max_tokens=9, system=system_prompt, messages=messages) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == TEXT and final.content[0].text == TEXT  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 9
    # The same conversation again: its replica serves the cached prefix, reported as Anthropic does.
    cached = final.usage.cache_read_input_tokens
    assert cached is not None and cached > 0
    assert final.usage.input_tokens + cached == message.usage.input_tokens
    # Anthropic's input_tokens leaves the cached part out; the picker adds it back.
    after = served(gateway.picker)
    assert (after[0] - before[0], after[1] - before[1]) == (2 * message.usage.input_tokens, cached)
