"""Peer-sync frames: round trip, authentication, bounds (extproc/sync/wire.py)."""

from __future__ import annotations

import zlib

import pytest

from extproc.sync.wire import LOAD, RECORD, REMOVE, SPECULATIVE, UPDATES, Codec, FrameError

SECRET = b"s" * 32


def codec(secret: bytes = SECRET, max_frame_bytes: int = 1 << 20) -> Codec:
    return Codec(secret, max_frame_bytes=max_frame_bytes, max_clock_skew_s=60)


def test_round_trip_keeps_every_record() -> None:
    c = codec()
    hashes = [0, 1, 2**64 - 1, 12345678901234567890]
    frame = c.encode(UPDATES, 42, [(RECORD, "10.0.0.1:8000", hashes), (REMOVE, "[fd00::1]:8000", ()),
                                   (SPECULATIVE, "10.0.0.2:8000", [7]), (LOAD, "x:1", hashes[::-1])])
    got = c.decode(frame)
    assert got.kind == UPDATES and got.origin == 42
    assert [(op, ep, list(h)) for op, ep, h in got.records] == [
        (RECORD, "10.0.0.1:8000", hashes), (REMOVE, "[fd00::1]:8000", []),
        (SPECULATIVE, "10.0.0.2:8000", [7]), (LOAD, "x:1", hashes[::-1])]


def test_shared_prefixes_compress() -> None:
    prefix = list(range(10**6, 10**6 + 100))
    records = [(RECORD, "10.0.0.1:8000", [*prefix, i]) for i in range(50)]
    frame = codec().encode(UPDATES, 1, records)
    assert len(frame) < 50 * 101 * 8 / 5  # at least 5x smaller than the raw hashes


def test_wrong_secret_and_tampering_are_refused() -> None:
    frame = codec().encode(UPDATES, 1, [(RECORD, "a:1", [1, 2, 3])])
    with pytest.raises(FrameError, match="authentication"):
        codec(b"t" * 32).decode(frame)
    tampered = bytearray(frame)
    tampered[-1] ^= 1
    with pytest.raises(FrameError, match="authentication"):
        codec().decode(bytes(tampered))
    with pytest.raises(FrameError):
        codec().decode(frame[:10])


def test_old_frames_and_bombs_are_refused() -> None:
    c = codec(max_frame_bytes=4096)
    old = c.encode(UPDATES, 1, [(RECORD, "a:1", [1])], sent_at=1000.0)
    with pytest.raises(FrameError, match="away from this clock"):
        c.decode(old)
    big = c.encode(UPDATES, 1, [(RECORD, "a:1", [5] * 4096)])  # 32 KB inflated, tiny compressed
    assert len(big) < 4096
    with pytest.raises(FrameError, match="larger than"):
        c.decode(big)


def test_garbage_with_a_valid_mac_is_refused() -> None:
    c = codec()
    body = zlib.compress(b"PX\x02\x09" + b"\x00" * 32)
    with pytest.raises(FrameError, match="unknown frame"):
        c.decode(c._mac(body) + body)


def test_empty_secret_is_refused() -> None:
    with pytest.raises(ValueError):
        codec(b"")
