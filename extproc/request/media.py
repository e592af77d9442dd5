"""Images (and other media parts) by their content: what the prefix hash sees of a media part.

The engine keys a multimodal item by its content, not by how it was sent: vLLM hashes the item's
original bytes (`MultiModalHasher`: the fetched or decoded file bytes), or the part's own `uuid`
when the client gives one. So an image sent inline twice is one item, and a URL and the same
image inline are one item only if the bytes behind the URL match, which the picker cannot know
without fetching it (it never does). What a part contributes here, in order of precedence:

1. the part's `uuid` (a string): `\\x1duuid:` + the uuid;
2. a data URL (`data:<type>;base64,<payload>`): `\\x1dmedia:` + the xxh3-128 digest of the
   payload, so equal bytes give the same marker whatever the media type says and whichever
   shape carried it (chat `image_url`, Responses `input_image`, Anthropic `image` blocks, which
   vLLM turns into the same data URL);
3. any other URL: `\\x1durl:` + the xxh3-128 digest of the URL;
4. an `input_audio` part's base64 `data`: as a data URL's payload;
5. anything else: `\\x1d` + the part's type.

Work is bounded: a payload up to `FULL_HASH_BYTES` (2 MiB) is hashed whole; a longer one by its
length, its first and its last `FULL_HASH_BYTES // 2` bytes, so a 50 MB data URL costs the same
2 MiB of hashing as a 2 MB one (two huge images that differ only in their middle then route
alike: routing only, the engine still tells them apart). The payload is never base64-decoded;
at most `FULL_HASH_BYTES` of it is encoded for the digest. Markers are a few dozen bytes, so
an image never fills the prefix blocks that the text after it needs.
"""

from __future__ import annotations

from typing import Any

import xxhash

FULL_HASH_BYTES = 2 * 1024 * 1024
_MARK = b"\x1d"


def _digest(text: str) -> str:
    if len(text) <= FULL_HASH_BYTES:
        return xxhash.xxh3_128_hexdigest(text.encode("utf-8", "surrogatepass"))
    half = FULL_HASH_BYTES // 2
    h = xxhash.xxh3_128()
    h.update(str(len(text)).encode())
    h.update(text[:half].encode("utf-8", "surrogatepass"))
    h.update(text[-half:].encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def url_identity(url: str) -> bytes:
    """The marker of a media URL: by payload for a base64 data URL, else by the URL itself."""
    if url.startswith("data:"):
        comma = url.find(",", 0, 256)
        if comma > 0 and url[:comma].endswith(";base64"):
            return _MARK + b"media:" + _digest(url[comma + 1:]).encode()
    return _MARK + b"url:" + _digest(url).encode()


def _url_of(part: dict[str, Any], kind: str) -> str | None:
    """The URL a part names: chat `image_url: {url}` or `image_url: "..."`, Responses
    `input_image: {image_url: "..."}`, audio/video/file parts alike."""
    ref = part.get(kind)
    if isinstance(ref, dict):
        ref = ref.get("url") if "url" in ref else ref.get("data")  # input_audio: {data, format}
    if not isinstance(ref, str):
        ref = part.get("image_url") if kind == "input_image" else None
    return ref if isinstance(ref, str) else None


def part_identity(part: dict[str, Any]) -> bytes:
    """The marker of a non-text content part (see the module docstring)."""
    uuid = part.get("uuid")
    if isinstance(uuid, str) and uuid:
        return _MARK + b"uuid:" + uuid.encode()
    kind = part.get("type")
    kind = kind if isinstance(kind, str) else ""
    url = _url_of(part, kind)
    if url is not None:
        return url_identity(url) if kind != "input_audio" else _MARK + b"media:" + _digest(url).encode()
    return _MARK + kind.encode()
