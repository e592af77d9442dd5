"""Images by their content: equal bytes give equal markers in every shape; huge data URLs cost bounded work."""

from __future__ import annotations

import base64

import orjson

from extproc.prefix.hashing import block_hashes
from extproc.request.media import FULL_HASH_BYTES, MEDIA_BYTES, part_identity, url_identity
from extproc.request.openai import Api, parse_request

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8).decode()
OTHER = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(range(255, -1, -1)) * 8).decode()


def _chat(url: str, text: str = "describe") -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]})


def test_an_inline_image_is_known_by_its_bytes_not_its_media_type() -> None:
    a = url_identity(f"data:image/png;base64,{PNG}")
    assert a == url_identity(f"data:image/jpeg;base64,{PNG}")
    assert a != url_identity(f"data:image/png;base64,{OTHER}")
    assert len(a) < 64  # a marker, not the payload
    # A URL is known by the URL: the picker never fetches it, so it cannot equal inline bytes.
    assert url_identity("https://example.com/cat.png") not in (a, url_identity("https://example.com/dog.png"))


def test_the_same_image_hashes_alike_in_chat_responses_and_messages() -> None:
    chat = parse_request(Api.CHAT, _chat(f"data:image/png;base64,{PNG}"))
    responses = parse_request(Api.RESPONSES, orjson.dumps({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "describe"},
        {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"}]}]}))
    messages = parse_request(Api.MESSAGES, orjson.dumps({"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "describe"}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": PNG}}]}]}))
    assert chat.segments == responses.segments == messages.segments
    other = parse_request(Api.CHAT, _chat(f"data:image/png;base64,{OTHER}"))
    assert other.segments != chat.segments


def test_a_client_uuid_names_the_item_as_the_engine_does() -> None:
    part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}, "uuid": "img-42"}
    assert part_identity(part) == part_identity({"type": "image_url", "image_url": {"url": "x"}, "uuid": "img-42"})
    assert part_identity(part) != part_identity({"type": "image_url", "image_url": {"url": "x"}, "uuid": "img-43"})


def test_a_huge_data_url_costs_bounded_work_and_leaves_the_text_after_it_hashed() -> None:
    huge = "A" * (40 * FULL_HASH_BYTES)
    a = url_identity(f"data:image/png;base64,{huge}")
    b = url_identity(f"data:image/png;base64,{huge[:-1]}B")  # the tail is read
    c = url_identity(f"data:image/png;base64,{huge}A")  # so is the length
    assert len({a, b, c}) == 3
    middle = len(huge) // 2
    # Only the first and last FULL_HASH_BYTES // 2 are read: a change in the middle is not seen.
    assert url_identity(f"data:image/png;base64,{huge[:middle]}B{huge[middle + 1:]}") == a
    p = parse_request(Api.CHAT, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{huge}"}}]},
        {"role": "user", "content": "the question"}]}))
    # The image is its marker and a fixed filler, not its payload: the next message keeps its blocks.
    assert sum(map(len, p.segments)) < MEDIA_BYTES + 200


def test_an_image_weighs_as_a_media_item_and_its_blocks_are_its_own() -> None:
    """The engine spends hundreds of tokens on an image: the part counts MEDIA_BYTES (MEDIA_TOKENS
    at ~4 bytes per token) whatever its payload's size, and two images that differ share no block
    from the one holding their markers on."""
    small = parse_request(Api.CHAT, _chat(f"data:image/png;base64,{PNG}"))
    big = parse_request(Api.CHAT, _chat(f"data:image/png;base64,{'A' * 400_000}"))
    text = parse_request(Api.CHAT, orjson.dumps({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "describe"}]}]}))
    weight = sum(map(len, text.segments)) + MEDIA_BYTES
    assert weight < sum(map(len, small.segments)) == sum(map(len, big.segments)) < weight + 64
    a = block_hashes(small.segments, "m", block_size=64, max_blocks=4096)
    b = block_hashes(parse_request(Api.CHAT, _chat(f"data:image/png;base64,{OTHER}")).segments, "m",
                     block_size=64, max_blocks=4096)
    assert len(a) == len(b) >= MEDIA_BYTES // 64
    assert not set(a) & set(b)  # "describe" and the marker share the first block
