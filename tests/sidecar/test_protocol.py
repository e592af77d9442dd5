"""The sidecar's protocol functions: the prefill and decode bodies, the header's value, headers."""

from __future__ import annotations

import pytest

from extproc.sidecar import protocol


@pytest.mark.parametrize(("value", "canonical"), [
    ("10.0.0.7:8000", "10.0.0.7:8000"),
    (" 127.0.0.2:80 ", "127.0.0.2:80"),
    ("[::1]:8200", "[::1]:8200"),
    ("[fd00:0::1]:8000", "[fd00::1]:8000"),
])
def test_an_ip_and_port_is_the_prefill_endpoint(value: str, canonical: str) -> None:
    assert protocol.host_port(value) == canonical


@pytest.mark.parametrize("value", [
    "", "10.0.0.7", "10.0.0.7:", "10.0.0.7:0", "10.0.0.7:65536", "10.0.0.7:80x", "prefill-0:8000",
    "http://10.0.0.7:8000", "::1:8000", "[10.0.0.7]:8000", "[::1:8000", "10.0.0.7:8000,10.0.0.8:8000",
    "10.0.0.7:8000/v1",
])
def test_anything_else_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="x-prefiller-host-port"):
        protocol.host_port(value)


def test_the_prefill_computes_one_token_not_streamed_and_leaves_the_clients_body_alone() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300,
            "max_completion_tokens": 300, "min_tokens": 20, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    before = dict(body)
    prefill = protocol.prefill_body(body, "chat", "shared-storage")
    assert prefill == {"model": "m", "messages": body["messages"], "max_tokens": 1, "max_completion_tokens": 1,
                       "stream": False, "temperature": 0}
    assert body == before
    completion = protocol.prefill_body({"model": "m", "prompt": "p", "stream": True}, "completion", "shared-storage")
    assert completion == {"model": "m", "prompt": "p", "max_tokens": 1, "stream": False}  # no chat-only cap


def test_nixlv2_asks_the_prefill_to_keep_its_blocks_and_passes_its_params_to_the_decode() -> None:
    body = {"model": "m", "prompt": "p", "max_tokens": 9, "stream": True}
    prefill = protocol.prefill_body(body, "completion", "nixlv2")
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                             "remote_engine_id": None, "remote_block_ids": None,
                                             "remote_host": None, "remote_port": None}
    answer = {"id": "cmpl-1", "choices": [], "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 4],
        "remote_engine_id": "e", "remote_host": "10.0.0.7", "remote_port": 5600}}
    params = protocol.decode_params(answer)
    assert params is not None
    assert protocol.decode_body(body, params) == {**body, "kv_transfer_params": answer["kv_transfer_params"]}
    assert protocol.decode_params({"kv_transfer_params": None}) is None
    assert protocol.decode_params([1]) is None


def test_hop_by_hop_headers_and_the_prefill_header_are_not_forwarded() -> None:
    headers = [("Host", "a"), ("Connection", "keep-alive, X-Hop"), ("X-Hop", "1"), ("Keep-Alive", "5"),
               ("TE", "trailers"), ("Transfer-Encoding", "chunked"), ("Upgrade", "h2c"),
               ("Content-Length", "12"), ("X-Prefiller-Host-Port", "10.0.0.7:8000"), ("Expect", "100-continue"),
               ("Authorization", "Bearer t"), ("X-Tag", "1"), ("X-Tag", "2")]
    kept = [("Authorization", "Bearer t"), ("X-Tag", "1"), ("X-Tag", "2")]
    assert protocol.forwarded(headers) == kept
    assert protocol.forwarded(headers, keep_length=True) == [("Content-Length", "12"), *kept]


def test_errors_are_openai_shaped() -> None:
    assert protocol.error_body(502, "no") == {"error": {"message": "no", "type": "BadGatewayError", "param": None,
                                                        "code": 502}}
