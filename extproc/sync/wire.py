"""Frames of the peer-sync protocol: authenticated, compressed batches of index records.

Frame = MAC (16 bytes) || zlib(payload, level 1).
MAC = HMAC-SHA256(shared secret, compressed bytes), truncated to 16 bytes. It is checked before
anything is decompressed, so a process without the secret can neither write into the index nor
make a replica inflate a bomb; the secret itself never travels.

Payload = header || records.
- header `<2sBBQd`: magic b"PX", version 1, kind, origin (random 64-bit id of the process that
  made the records; a frame is never applied by its origin, so forwarded frames cannot echo),
  sent-at (Unix time; frames further than `max_clock_skew_s` from the receiver's clock are refused,
  which bounds replays of captured frames).
- record `<BBI`: op, length of the endpoint key, number of hashes; then the key (UTF-8) and the
  hashes as little-endian uint64.

Kinds: UPDATES (decisions as they happen), HELLO (identity exchange, no records), SNAPSHOT
(one chunk of a peer's index, LOAD records oldest first), SNAPSHOT_REQUEST.
Ops: RECORD (approximate index, hashes as the request had them), REMOVE (endpoint left the pool,
no hashes), SPECULATIVE (precise index keys of a decision), LOAD (snapshot: oldest first).

Leading blocks of prompts with a shared prefix repeat across the records of one frame, so zlib
shrinks a frame of shared-prefix traffic several-fold (bench/sync.py measures it).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import sys
import time
import zlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MAGIC = b"PX"
VERSION = 1
MAC_BYTES = 16

UPDATES, HELLO, SNAPSHOT, SNAPSHOT_REQUEST = 1, 2, 3, 4
RECORD, REMOVE, SPECULATIVE, LOAD = 1, 2, 3, 4
_KINDS = {UPDATES, HELLO, SNAPSHOT, SNAPSHOT_REQUEST}
_OPS = {RECORD, REMOVE, SPECULATIVE, LOAD}

_HEADER = struct.Struct("<2sBBQd")
_RECORD = struct.Struct("<BBI")
_BIG_ENDIAN = sys.byteorder == "big"


class FrameError(ValueError):
    """A frame that is not authentic, not well formed, too large or too old."""


Record = tuple[int, str, Sequence[int]]  # (op, endpoint key, hashes)


@dataclass(frozen=True, slots=True)
class Frame:
    kind: int
    origin: int
    sent_at: float
    records: list[Record]


class Codec:
    """Encodes and checks frames with one shared secret."""

    def __init__(self, secret: bytes, *, max_frame_bytes: int, max_clock_skew_s: float) -> None:
        if not secret:
            raise ValueError("peer sync needs a non-empty shared secret")
        self._secret = secret
        self.max_frame_bytes = max_frame_bytes
        self.max_clock_skew_s = max_clock_skew_s

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._secret, body, hashlib.sha256).digest()[:MAC_BYTES]

    def encode(self, kind: int, origin: int, records: Iterable[Record] = (), sent_at: float | None = None) -> bytes:
        parts = [_HEADER.pack(MAGIC, VERSION, kind, origin, time.time() if sent_at is None else sent_at)]
        for op, endpoint, hashes in records:
            key = endpoint.encode()
            if len(key) > 255:
                raise ValueError(f"endpoint key too long: {endpoint[:40]!r}")
            packed = hashes if isinstance(hashes, array) and hashes.typecode == "Q" else array("Q", hashes)
            if _BIG_ENDIAN:
                packed = array("Q", packed)
                packed.byteswap()
            parts.append(_RECORD.pack(op, len(key), len(packed)))
            parts.append(key)
            parts.append(packed.tobytes())
        body = zlib.compress(b"".join(parts), 1)
        return self._mac(body) + body

    def decode(self, frame: bytes, now: float | None = None) -> Frame:
        if len(frame) <= MAC_BYTES:
            raise FrameError("frame too short")
        mac, body = frame[:MAC_BYTES], frame[MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(body)):
            raise FrameError("bad frame authentication code")
        inflater = zlib.decompressobj()
        try:
            payload = inflater.decompress(body, self.max_frame_bytes)
        except zlib.error as exc:
            raise FrameError(f"not a zlib stream: {exc}") from None
        if inflater.unconsumed_tail:
            raise FrameError(f"frame larger than {self.max_frame_bytes} bytes")
        if len(payload) < _HEADER.size:
            raise FrameError("frame header truncated")
        magic, version, kind, origin, sent_at = _HEADER.unpack_from(payload)
        if magic != MAGIC or version != VERSION or kind not in _KINDS:
            raise FrameError(f"unknown frame (magic {magic!r}, version {version}, kind {kind})")
        now = time.time() if now is None else now
        if abs(now - sent_at) > self.max_clock_skew_s:
            raise FrameError(f"frame stamped {now - sent_at:.0f}s away from this clock")
        return Frame(kind, origin, sent_at, _records(payload, _HEADER.size))


def _records(payload: bytes, pos: int) -> list[Record]:
    view = memoryview(payload)
    out: list[Record] = []
    end = len(payload)
    while pos < end:
        if end - pos < _RECORD.size:
            raise FrameError("record header truncated")
        op, key_len, n = _RECORD.unpack_from(payload, pos)
        pos += _RECORD.size
        stop = pos + key_len + 8 * n
        if op not in _OPS or stop > end:
            raise FrameError(f"bad record (op {op}, {n} hashes)")
        endpoint = bytes(view[pos:pos + key_len]).decode("utf-8", errors="replace")
        hashes = array("Q")
        hashes.frombytes(view[pos + key_len:stop])
        if _BIG_ENDIAN:
            hashes.byteswap()
        out.append((op, endpoint, hashes))
        pos = stop
    return out
