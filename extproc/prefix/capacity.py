"""Index capacity tuned to the engine's KV cache, so the index forgets when the engine would.

An engine that reports `vllm:cache_config_info` (num_gpu_blocks, block_size) holds
`num_gpu_blocks * block_size` tokens; at the learned bytes per token that is as many prompt bytes,
so the approximate index keeps `tokens * bytes_per_token // block_size_bytes` blocks for it (at
least 1). Unknown (no cache info scraped) gives None and the configured capacity stays.
"""

from __future__ import annotations

from extproc.core.datastore import ModelServerMetrics


def auto_tuned_capacity(m: ModelServerMetrics, block_size_bytes: int, bytes_per_token: float) -> int | None:
    """Prefix-index capacity (in index blocks) matching the engine's KV cache, or None if unknown."""
    if m.num_gpu_blocks <= 0 or m.block_size <= 0:
        return None
    return max(1, int(m.num_gpu_blocks * m.block_size * bytes_per_token // block_size_bytes))
