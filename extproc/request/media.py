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
at most `FULL_HASH_BYTES` of it is encoded for the digest.

Weight: the engine spends hundreds of prompt tokens on one image (LLaVA-1.5 576, Gemma 3 256,
Qwen2.5-VL about one per 28x28 pixels: 1,344 at 1024x1024), plus the encoder pass, all of
which a warm cache saves. A marker of a few dozen bytes would count as a handful of tokens, so a
follow-up turn about a cached image would weigh its warm endpoint at almost nothing and go to
whichever endpoint is measured fastest. So `part_identity` follows the marker with
`MEDIA_TOKENS` (576) tokens' worth of fixed filler (`MEDIA_BYTES`, at the picker's ~4 bytes per
token): the prefix blocks after the marker chain from it, so they are as distinct as the marker,
and the cost model prices the item as a typical image (the slowdown and bytes-per-token
calibration absorb a model whose images cost more or less). 36 blocks of the default 64 bytes,
far inside `--prefix-max-blocks`; the filler is one shared constant, copied once into the
segment.
"""

from __future__ import annotations

from typing import Any

import xxhash

from extproc.config.settings import PrefixConfig

FULL_HASH_BYTES = 2 * 1024 * 1024
MEDIA_TOKENS = 576  # prompt tokens one media item is priced at (see the module docstring)
MEDIA_BYTES = MEDIA_TOKENS * PrefixConfig.bytes_per_token
_MARK = b"\x1d"
_FILLER = _MARK * MEDIA_BYTES


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


def _marker(part: dict[str, Any]) -> bytes:
    uuid = part.get("uuid")
    if isinstance(uuid, str) and uuid:
        return _MARK + b"uuid:" + uuid.encode()
    kind = part.get("type")
    kind = kind if isinstance(kind, str) else ""
    url = _url_of(part, kind)
    if url is not None:
        return url_identity(url) if kind != "input_audio" else _MARK + b"media:" + _digest(url).encode()
    return _MARK + kind.encode()


def part_identity(part: dict[str, Any]) -> bytes:
    """What a non-text content part contributes to its segment: its marker, then the filler that
    gives it a media item's weight (see the module docstring)."""
    return _marker(part) + _FILLER
