"""Request control, between the transport and the scheduler.

- `director`: a request's candidates, its parsed body and tokens, the scheduler's decision;
  reaches the precise index only through the `PreciseKeys` protocol.
- `affinity`: client-sent affinity keys (prompt_cache_key, a session header), hashed.
- `usage`: the closed loop: what the engine reports it reused against what the picker predicted.
"""
