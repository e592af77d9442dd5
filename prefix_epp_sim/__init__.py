"""A vLLM-compatible model-server simulator with a real prefix-cache model.

Modules, one concept each: `config` (every knob and default), `kvcache` (paged cache, block
hashing, events), `engine` (continuous-batching scheduler and cost model), `kv_publisher` (ZeroMQ
publisher in vLLM's wire format), `vllm_metrics` (vLLM-named Prometheus exposition), `openai_api`
(request/response shapes), `render` (vLLM's render routes: token ids without generating),
`server` (aiohttp routes, `run_replicas`), `clairvoyant` (the benchmark's reference router: a
front that routes on the replicas' true state), `cli` (`prefix-epp sim`).
"""

from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.server import Replica, run_replicas

__all__ = ["Replica", "SimConfig", "run_replicas"]
