"""Precise prefix routing from engine KV-cache events (vLLM's ZeroMQ publisher).

- `keys`: our block keys, chained xxhash64 over packed uint32 token ids (requests and events).
- `wire`: decoding of the three-frame messages and both msgpack encodings.
- `index`: the dual-key precise index (our key -> endpoints; engine hash -> our key per source).
- `limits`: what an engine may send (frame size, queues, replay size, a byte budget per source).
- `subscriber`: one SUB socket per (endpoint, data-parallel rank), sequence checks, replay, resync.
- `manager`: subscriptions follow the datastore; what the request path reads (match, record).
"""
