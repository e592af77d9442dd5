from __future__ import annotations

import random
import subprocess
import sys

import xxhash

from extproc.prefix.hashing import affinity_hash, block_hashes, prefix_seed

BS, MAX = 64, 256  # block size in bytes, blocks at most


def hashes(segments: list[bytes], model: str, cache_salt: str = "", max_blocks: int = MAX) -> list[int]:
    return block_hashes(segments, model, cache_salt, block_size=BS, max_blocks=max_blocks)


def test_blocks_and_cap() -> None:
    assert len(hashes([b"x" * 64], "m")) == 1
    assert len(hashes([b"x" * 65], "m")) == 2
    assert len(hashes([b"x" * 640], "m", max_blocks=4)) == 4
    assert hashes([], "m") == []


def test_the_definition_over_random_segments_block_sizes_and_caps() -> None:
    """h_i = xxh64(block_i, seed=h_(i-1)) from the model's seed, blocks cut per segment (empty ones
    included), at most max_blocks (a cap may fall inside a segment)."""
    rng = random.Random(3)
    for _ in range(500):
        segments = [rng.randbytes(rng.randrange(0, 200)) for _ in range(rng.randrange(0, 5))]
        size, cap = rng.randrange(1, 70), rng.randrange(0, 12)
        h, expected = prefix_seed("m", "salt"), []
        for seg in segments:
            for start in range(0, len(seg), size):
                h = xxhash.xxh64_intdigest(seg[start:start + size], h)
                expected.append(h)
        assert block_hashes(segments, "m", "salt", block_size=size, max_blocks=cap) == expected[:cap]


def test_chain_identifies_whole_prefix() -> None:
    a = hashes([b"A" * 64 + b"B" * 64], "m")
    b = hashes([b"C" * 64 + b"B" * 64], "m")
    assert a[1] != b[1], "equal blocks after different prefixes must hash differently"
    common = hashes([b"A" * 64 + b"B" * 64 + b"tail-1"], "m")
    other = hashes([b"A" * 64 + b"B" * 64 + b"tail-2"], "m")
    assert common[:2] == other[:2] == a
    assert common[2] != other[2]


def test_model_and_salt_scope_hashes() -> None:
    base = hashes([b"x" * 128], "m")
    assert hashes([b"x" * 128], "other") != base
    assert hashes([b"x" * 128], "m", cache_salt="s") != base
    assert hashes([b"x" * 128], "m", cache_salt="") == base


def test_segments_align_blocks() -> None:
    turn1 = [b"system\x1f" + b"s" * 100, b"user\x1fq1"]
    turn2 = [*turn1, b"assistant\x1fa1", b"user\x1fq2"]
    h1 = hashes(turn1, "m")
    h2 = hashes(turn2, "m")
    assert len(h1) == 3  # 107 bytes -> 2 blocks, plus the short user message
    assert h2[: len(h1)] == h1
    assert len(h2) == 5


def test_stable_across_processes() -> None:
    code = ("from extproc.prefix.hashing import block_hashes; "
            f"print(block_hashes([b'hello world'*20], 'm', block_size={BS}, max_blocks={MAX}))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outs) == 1
    assert outs.pop().strip() == str(hashes([b"hello world" * 20], "m"))


def test_affinity_hash_has_its_own_domain() -> None:
    key = affinity_hash("m", "", "user-1")
    assert affinity_hash("m", "", "user-1") == key
    assert affinity_hash("other", "", "user-1") != key  # same key, other model
    assert affinity_hash("m", "salt", "user-1") != key  # same key, other cache salt
    assert affinity_hash("m", "", "user-2") != key
    # A key whose text equals a prompt's first block never stands for that block.
    for text in ("user-1", "x" * 64, ""):
        assert affinity_hash("m", "", text) not in hashes([text.encode()], "m")
