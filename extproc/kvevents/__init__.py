"""Precise prefix routing from engine KV-cache events (vLLM's ZeroMQ publisher).

- `keys`: our block keys, chained xxhash64 over packed uint32 token ids (requests and events).
- `wire`: decoding of the three-frame messages and both msgpack encodings.
- `index`: the dual-key precise index (our key -> endpoints; engine hash -> our key per source).
- `slots`: the index's slots: one source's entries on one KV cache tier, or an endpoint's predicted ones.
- `tiers`: KV cache tier weights and the match that weighs a prefix by the tier holding each block.
- `limits`: what an engine may send (frame size, queues, replay size, a byte budget per source).
- `subscriber`: one SUB socket per (endpoint, data-parallel rank), sequence checks, replay, resync.
- `manager`: subscriptions follow the datastore; what the request path reads (match, record).
"""
