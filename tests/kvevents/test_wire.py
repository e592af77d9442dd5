"""Decoding vLLM KV-event payloads: both encodings, both hash forms, old and new field sets."""

from __future__ import annotations

import msgpack
import pytest

from extproc.kvevents.wire import CPU, GPU, Cleared, Removed, Stored, WireError, decode_batch, normalize_hash
from prefix_epp_sim.kv_publisher import encode_batch
from prefix_epp_sim.kvcache import AllBlocksCleared, BlockRemoved, BlockStored

EVENTS = [
    BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(32)), block_size=16),
    BlockStored(block_hashes=[13], parent_block_hash=12, token_ids=list(range(32, 48)), block_size=16,
                lora_id=1, lora_name="adapter"),
    BlockRemoved(block_hashes=[11]),
    AllBlocksCleared(),
]


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_both_encodings_decode_to_the_same_events(encoding: str) -> None:
    batch = decode_batch(encode_batch(EVENTS, encoding, ts=12.5, data_parallel_rank=1))  # type: ignore[arg-type]
    assert batch.ts == 12.5 and batch.rank == 1 and batch.unknown == 0
    group = 0 if encoding == "map" else None  # vLLM 0.32's map form names the KV-cache group
    assert batch.events == [
        Stored([11, 12], None, list(range(32)), 16, None, True, group),
        Stored([13], 12, list(range(32, 48)), 16, "adapter", True, group),
        Removed([11], True, group),
        Cleared(),
    ]


def test_hash_forms_normalise_to_unsigned_64_bits() -> None:
    assert normalize_hash(2**64 - 1) == 2**64 - 1
    assert normalize_hash(-1) == 2**64 - 1  # an old publisher's signed int64
    assert normalize_hash(2**70 + 5) == 5  # beyond 64 bits: the low 64 bits, as vLLM keeps
    digest = bytes(range(32))  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: the raw sha256 digest
    assert normalize_hash(digest) == int.from_bytes(digest[-8:], "big")
    with pytest.raises(WireError):
        normalize_hash(True)
    payload = msgpack.packb([0.0, [["BlockStored", [digest], None, list(range(16)), 16, None, "GPU"],
                                   {"type": "BlockRemoved", "block_hashes": [-1]}], None])
    stored, removed = decode_batch(payload).events
    assert isinstance(stored, Stored) and isinstance(removed, Removed)
    assert stored.block_hashes == [normalize_hash(digest)] and removed.block_hashes == [2**64 - 1]


def test_old_and_new_field_sets_and_unindexable_blocks() -> None:
    v09 = ["BlockStored", [1], None, list(range(16)), 16, None]  # vLLM 0.9: no medium
    cpu = ["BlockStored", [2], None, list(range(16)), 16, None, "CPU"]
    salted = {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": None, "token_ids": list(range(16)),
              "block_size": 16, "medium": "GPU", "extra_keys": [["salt"]], "group_idx": 0}
    group1 = {"type": "BlockStored", "block_hashes": [4], "parent_block_hash": None, "token_ids": list(range(16)),
              "block_size": 16, "group_idx": 1, "kv_cache_spec_kind": "sliding_window"}
    unknown = ["SomethingNew", 1, 2]
    disk = ["BlockStored", [5], None, list(range(16)), 16, None, "DISK"]  # a medium we do not know
    batch = decode_batch(msgpack.packb({"ts": 1.0, "events": [v09, cpu, salted, group1, disk, unknown]}))
    assert [e.indexable for e in batch.events if isinstance(e, Stored)] == [True, True, False, False, False]
    assert [e.tier for e in batch.events if isinstance(e, Stored)][:2] == [GPU, CPU]
    assert batch.unknown == 1 and batch.rank is None


@pytest.mark.parametrize("payload", [b"\xc1garbage", msgpack.packb({"not": "a batch"}), msgpack.packb([1.0, 5]),
                                     msgpack.packb([1.0, [["BlockStored", [1], None, "x", 16]]])])
def test_undecodable_payloads_raise(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


def _stored(hashes: list[int], group: int | None, kind: str | None) -> list[object]:
    """vLLM's array form: ..., lora_name, extra_keys, group_idx, kv_cache_spec_kind, sliding_window."""
    return ["BlockStored", hashes, None, list(range(16)), 16, None, "GPU", None, None, group, kind, None]


@pytest.mark.parametrize(("kind", "group", "indexable"), [
    ("full_attention", 0, True), ("full_attention", 2, True), ("mla_attention", 0, True),
    ("sink_full_attention", 1, True), ("sliding_window", 0, False), ("sliding_window_mla", 0, False),
    ("mamba", 0, False), ("chunked_local_attention", 0, False), ("unknown", 0, False), ("new_kind", 0, False),
    (None, 0, True), (None, None, True), (None, 1, False),
])
def test_only_full_attention_groups_are_prefix_residency(kind: str | None, group: int | None,
                                                         indexable: bool) -> None:
    (event,) = decode_batch(msgpack.packb([1.0, [_stored([5], group, kind)]])).events
    assert isinstance(event, Stored) and event.indexable is indexable and event.group == group
    (removed,) = decode_batch(msgpack.packb([1.0, [["BlockRemoved", [5], "GPU", group]]])).events
    assert isinstance(removed, Removed) and removed.group == group and removed.indexable
