"""Frames of the peer-sync protocol: authenticated, compressed batches of index records.

Frame = MAC (16 bytes) || zlib(payload, level 1), at most `max_frame_bytes` (3 MiB) on the wire
and at most that once inflated. The length is checked first, then the MAC =
HMAC-SHA256(shared secret, compressed bytes), truncated to 16 bytes, before anything is
decompressed, so a process without the secret can neither write into the index nor make a
replica inflate a bomb; the secret itself never travels. `decode` is pure CPU work on bytes
(OpenSSL and zlib release the GIL on large buffers): extproc/sync/admission.py runs it on a
thread, never on the event loop.

Payload = header || records.
- header `<2sBBQdQQ`: magic b"PX", version 2, kind, origin (random 64-bit id of the process that
  made the records; a frame is never applied by its origin, so forwarded frames cannot echo),
  sent-at (Unix time; frames further than `max_clock_skew_s` from the receiver's clock are
  refused), seq (1, 2, 3, ... per origin: every frame a process makes gets the next one, so a
  receiver refuses a frame it has seen before, extproc/sync/replay.py), reply-to (the seq of the
  request a HELLO_REPLY or SNAPSHOT frame answers; 0 otherwise).
- record `<BBI`: op, length of the endpoint key, number of hashes; then the key (UTF-8) and the
  hashes as little-endian uint64.

Kinds: UPDATES (decisions as they happen), HELLO (identity exchange, no records), HELLO_REPLY
(the answer to one HELLO: it names the HELLO's seq, so a HELLO sent back to its maker, or an old
reply, answers nothing), SNAPSHOT (one chunk of a peer's index, LOAD records oldest first),
SNAPSHOT_REQUEST. Version 1 (no seq) is refused: it cannot be guarded against replays.

Size of a legitimate frame: an UPDATES frame holds at most `max_batch_records` (1,024) records of
at most `max_batch_hashes` (262,144) hashes in all, i.e. 36 B header + 1,024 x (6 B + a key of at
most 255 B) + 262,144 x 8 B = 2,364,452 B inflated, and random hashes do not shrink; a snapshot
chunk is 32,768 hashes (256 KiB). 3 MiB leaves a third more than that. A single record with more
hashes than a frame may hold (a `--prefix-max-blocks` above 393,000) is dropped by the sender and
counted, never sent to be refused.
Ops: RECORD (approximate index, hashes as the request had them), REMOVE (endpoint left the pool,
no hashes), SPECULATIVE (precise index keys of a decision), LOAD (snapshot: oldest first).

Leading blocks of prompts with a shared prefix repeat across the records of one frame, so zlib
shrinks a frame of shared-prefix traffic several-fold (bench/sync.py measures it).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import struct
import sys
import time
import zlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MAGIC = b"PX"
VERSION = 2
MAC_BYTES = 16

UPDATES, HELLO, SNAPSHOT, SNAPSHOT_REQUEST, HELLO_REPLY = 1, 2, 3, 4, 5
RECORD, REMOVE, SPECULATIVE, LOAD = 1, 2, 3, 4
_KINDS = {UPDATES, HELLO, SNAPSHOT, SNAPSHOT_REQUEST, HELLO_REPLY}
_OPS = {RECORD, REMOVE, SPECULATIVE, LOAD}

_HEADER = struct.Struct("<2sBBQdQQ")
_RECORD = struct.Struct("<BBI")
_BIG_ENDIAN = sys.byteorder == "big"


# Why a frame is refused: the `reason` label of prefix_epp_sync_rejected_frames_total (a fixed set).
UNAUTHENTICATED, MALFORMED, TOO_LARGE, STALE, REPLAYED, THROTTLED, BAD_REPLY = (
    "unauthenticated", "malformed", "too_large", "stale", "replayed", "throttled", "bad_reply")
REASONS = (UNAUTHENTICATED, MALFORMED, TOO_LARGE, STALE, REPLAYED, THROTTLED, BAD_REPLY)


class FrameError(ValueError):
    """A frame that is not authentic, not well formed, too large, too old or seen before."""

    def __init__(self, message: str, reason: str = MALFORMED) -> None:
        super().__init__(message)
        self.reason = reason


Record = tuple[int, str, Sequence[int]]  # (op, endpoint key, hashes)


@dataclass(frozen=True, slots=True)
class Frame:
    kind: int
    origin: int
    sent_at: float
    seq: int
    reply_to: int
    records: list[Record]


class Codec:
    """Encodes and checks frames with one shared secret."""

    def __init__(self, secret: bytes, *, max_frame_bytes: int, max_clock_skew_s: float) -> None:
        if not secret:
            raise ValueError("peer sync needs a non-empty shared secret")
        self._secret = secret
        self.max_frame_bytes = max_frame_bytes
        self.max_clock_skew_s = max_clock_skew_s
        self._seq = itertools.count(1)  # encode runs on one event loop: no lock needed

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._secret, body, hashlib.sha256).digest()[:MAC_BYTES]

    def encode(self, kind: int, origin: int, records: Iterable[Record] = (), sent_at: float | None = None,
               reply_to: int = 0) -> bytes:
        return self.encode_seq(kind, origin, records, sent_at, reply_to)[1]

    def encode_seq(self, kind: int, origin: int, records: Iterable[Record] = (), sent_at: float | None = None,
                   reply_to: int = 0) -> tuple[int, bytes]:
        """(seq, frame): the frame and the sequence number it carries (a request's answer names it)."""
        seq = next(self._seq)
        stamp = time.time() if sent_at is None else sent_at
        parts = [_HEADER.pack(MAGIC, VERSION, kind, origin, stamp, seq, reply_to)]
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
        return seq, self._mac(body) + body

    def decode(self, frame: bytes, now: float | None = None) -> Frame:
        """The frame's content, or FrameError (with its `reason`): length, then MAC, then the rest."""
        if len(frame) > self.max_frame_bytes:
            raise FrameError(f"frame of {len(frame)} bytes, more than {self.max_frame_bytes}", TOO_LARGE)
        if len(frame) <= MAC_BYTES:
            raise FrameError("frame too short")
        mac, body = frame[:MAC_BYTES], frame[MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(body)):
            raise FrameError("bad frame authentication code", UNAUTHENTICATED)
        inflater = zlib.decompressobj()
        try:
            payload = inflater.decompress(body, self.max_frame_bytes)
        except zlib.error as exc:
            raise FrameError(f"not a zlib stream: {exc}") from None
        if inflater.unconsumed_tail:
            raise FrameError(f"frame larger than {self.max_frame_bytes} bytes", TOO_LARGE)
        if len(payload) < _HEADER.size:
            raise FrameError("frame header truncated")
        magic, version, kind, origin, sent_at, seq, reply_to = _HEADER.unpack_from(payload)
        if magic != MAGIC or version != VERSION or kind not in _KINDS:
            raise FrameError(f"unknown frame (magic {magic!r}, version {version}, kind {kind})")
        now = time.time() if now is None else now
        if abs(now - sent_at) > self.max_clock_skew_s:
            raise FrameError(f"frame stamped {now - sent_at:.0f}s away from this clock", STALE)
        return Frame(kind, origin, sent_at, seq, reply_to, _records(payload, _HEADER.size))


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
