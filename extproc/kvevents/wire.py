"""Decoding vLLM KV-event payloads (msgpack `EventBatch`), tolerant of every known variant.

Message: [topic, 8-byte big-endian sequence, msgpack payload] (see extproc/kvevents/subscriber.py).
Payload: EventBatch `[ts, [event, ...], data_parallel_rank]` (a map with the same field names is
accepted too). Each event is either a tagged array (vLLM's `array_like` structs, fields in
declaration order, trailing defaults possibly omitted) or a map with a `"type"` key:

    BlockStored      block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                     lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window,
                     locality
    BlockRemoved     block_hashes, medium, group_idx, locality
    AllBlocksCleared (no fields)

Hashes: an int (vLLM's default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, also negative or beyond
int64 from old publishers) or raw bytes. Both are normalised to an unsigned 64-bit int: ints are
masked to 64 bits, bytes give their last 8 bytes big-endian (what vLLM's own int conversion
keeps), so one engine's hashes compare equal whichever form it sends.

Tiers (`medium`): None or "GPU" is tier 0 (`GPU`), "CPU" tier 1 (`CPU`), "STORAGE" tier 2
(`STORAGE`), as `Stored.tier` / `Removed.tier`; any other medium is not indexable. vLLM's
offloading connector stores and evicts blocks on CPU and STORAGE; without its
`self_describing_kv_events` its `BlockStored` is a *placeholder*: the hash of each offloaded
chunk's last block, no `token_ids`, `block_size` 0 (`Stored.placeholder`); the precise index
resolves it through the blocks the engine announced on its GPU tier. A placeholder is accepted on a
lower tier only (a GPU store without tokens is malformed). An event whose `locality` is "REMOTE"
(a block in a pool shared with other engines, not this engine's own) is not indexable.

A stored block is `indexable` only when our keys can reproduce it and it is prefix residency: no
per-block `extra_keys` (multimodal hashes, `cache_salt`, prompt embeddings), a known tier, and a
full-attention KV group. A group's
`kv_cache_spec_kind` says which it is: `full_attention`, `mla_attention` and
`sink_full_attention` keep every token of the prefix (`FULL_ATTENTION_KINDS`); `sliding_window`,
`sliding_window_mla`, `chunked_local_attention`, `mamba` and any other kind keep only a window or
a state, so a hybrid model's (DeepSeek-V4, Kimi-K3, Gemma) blocks of those groups would claim a
prefix the engine cannot reuse: they never count. An event without the kind (publishers before
it) counts for group 0 (or no group) only. `Stored.group` / `Removed.group` carry `group_idx`: the
precise index (extproc/kvevents/index.py) indexes one full-attention group per source and applies
only that group's removals (a sliding window's removals leave the full group's blocks resident).
Unknown event types are counted and skipped; a payload that is not an EventBatch raises
`WireError` (the subscriber then resyncs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from extproc.config.settings import KV_TIERS

MASK64 = (1 << 64) - 1
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                  "locality")
FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality")
GPU, CPU, STORAGE = 0, 1, 2  # tiers, fastest first
TIERS = KV_TIERS  # their names (settings, metric labels), by tier
_MEDIUM_TIERS = {"GPU": GPU, "CPU": CPU, "STORAGE": STORAGE}


class WireError(ValueError):
    """The payload is not a KV-event batch."""


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: list[int]
    parent: int | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    indexable: bool = True
    group: int | None = None  # group_idx (None: the publisher does not say)
    tier: int = GPU

    @property
    def placeholder(self) -> bool:
        """An offloaded block named by its engine hash alone (no tokens): resolved through the GPU tier."""
        return not self.token_ids


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: list[int]
    indexable: bool = True
    group: int | None = None
    tier: int = GPU


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: list[Event]
    rank: int | None
    unknown: int = 0  # events of an unknown type, skipped


def normalize_hash(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value & MASK64
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value[-8:], "big")
    raise WireError(f"block hash of unexpected type {type(value).__name__}")


def _hashes(value: Any) -> list[int]:
    if not isinstance(value, list | tuple):
        raise WireError("block_hashes must be a list")
    return [normalize_hash(h) for h in value]


def _fields(event: Any, names: tuple[str, ...]) -> tuple[str, dict[str, Any]] | None:
    """(type, fields by name) of an array or map event; None for an unrecognised shape."""
    if isinstance(event, dict):
        kind = event.get("type")
        return (kind, event) if isinstance(kind, str) else None
    if isinstance(event, list | tuple) and event and isinstance(event[0], str):
        return event[0], dict(zip(names, event[1:], strict=False))
    return None


def _tier(f: dict[str, Any]) -> int | None:
    """The event's tier; None for a medium we do not know, or a block not this engine's own."""
    if f.get("locality") == "REMOTE":
        return None
    medium = f.get("medium")
    if medium is None:
        return GPU
    return _MEDIUM_TIERS.get(medium.upper()) if isinstance(medium, str) else None


def _group(f: dict[str, Any]) -> int | None:
    group = f.get("group_idx")
    return group if type(group) is int else None


def _full_attention(f: dict[str, Any]) -> bool:
    """Prefix residency: a full-attention group, or group 0 when the publisher names no kind."""
    kind = f.get("kv_cache_spec_kind")
    if kind is None:
        return f.get("group_idx") in (None, 0)
    return isinstance(kind, str) and kind.lower() in FULL_ATTENTION_KINDS


def decode_event(event: Any) -> Event | None:
    """One event, or None when its type is unknown."""
    kind = event[0] if isinstance(event, list | tuple) and event else (
        event.get("type") if isinstance(event, dict) else None)
    if kind == "BlockStored":
        parsed = _fields(event, _STORED_FIELDS)
        assert parsed is not None
        f = parsed[1]
        tokens = f.get("token_ids")
        block_size = f.get("block_size")
        tier = _tier(f)
        placeholder = tokens == [] and block_size == 0 and tier not in (GPU, None)
        if not isinstance(tokens, list) or not isinstance(block_size, int) or (block_size <= 0 and not placeholder):
            raise WireError("BlockStored needs token_ids and a positive block_size")
        parent = f.get("parent_block_hash")
        extra = f.get("extra_keys")
        lora = f.get("lora_name")
        return Stored(
            block_hashes=_hashes(f.get("block_hashes")),
            parent=None if parent is None else normalize_hash(parent),
            token_ids=tokens,
            block_size=block_size,
            lora_name=lora if isinstance(lora, str) else None,
            indexable=tier is not None and _full_attention(f) and (not extra or all(e is None for e in extra)),
            group=_group(f),
            tier=GPU if tier is None else tier,
        )
    if kind == "BlockRemoved":
        parsed = _fields(event, _REMOVED_FIELDS)
        assert parsed is not None
        f = parsed[1]
        tier = _tier(f)
        return Removed(block_hashes=_hashes(f.get("block_hashes")), indexable=tier is not None, group=_group(f),
                       tier=GPU if tier is None else tier)
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


def decode_batch(payload: bytes) -> Batch:
    """Decode one payload; raises WireError when it is not an EventBatch."""
    try:
        doc = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise WireError(f"not msgpack: {type(exc).__name__}") from None
    if isinstance(doc, dict):
        doc = [doc.get("ts", 0.0), doc.get("events"), doc.get("data_parallel_rank")]
    if not isinstance(doc, list | tuple) or len(doc) < 2 or not isinstance(doc[1], list | tuple):
        raise WireError("payload is not an EventBatch [ts, events, rank]")
    rank = doc[2] if len(doc) > 2 and isinstance(doc[2], int) else None
    events: list[Event] = []
    unknown = 0
    for raw in doc[1]:
        ev = decode_event(raw)
        if ev is None:
            unknown += 1
        else:
            events.append(ev)
    ts = doc[0] if isinstance(doc[0], int | float) else 0.0
    return Batch(ts=float(ts), events=events, rank=rank, unknown=unknown)
