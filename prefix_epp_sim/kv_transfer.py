"""KV transfer between simulated engines, as vLLM's KV connectors do it for prefill/decode pairs.

Configured as vLLM is, by `--kv-transfer-config '<json>'` (`SimConfig.kv_connector`, `kv_role`,
`kv_shared_storage_path`); without it nothing here runs and every request is as before.

`nixl` (vLLM's NixlConnector, the protocol llm-d's sidecar calls `nixlv2`)
    A request whose `kv_transfer_params` say `do_remote_decode: true` is a prefill for a remote
    decode: its answer carries `kv_transfer_params` {do_remote_prefill: true, do_remote_decode:
    false, remote_block_ids: the ids of the prompt's full blocks on this replica, remote_engine_id:
    the replica's engine id, remote_request_id, remote_host and remote_port: this replica's
    address, tp_size: 1}. A request whose `kv_transfer_params` say `do_remote_prefill: true` with
    `remote_block_ids` is that decode: its first len(remote_block_ids) prompt blocks are loaded
    from the remote engine (no bytes move here; the count is taken as given).
`shared-storage` (vLLM's ExampleConnector)
    A producer (`kv_producer`, `kv_both`) writes the hashes of a request's full prompt blocks to
    the shared directory when the request finishes, one empty file per block named by its hash; a
    consumer (`kv_consumer`, `kv_both`) loads, at arrival, the leading prompt blocks whose files it
    finds there. File I/O runs in a thread, off the event loop.

Either way, loaded blocks count beyond the replica's own prefix hit (`Engine._admit`): they are
stored in its cache as if computed (BlockStored events), at most as many as leave the last prompt
token to compute, as vLLM does. A request reports them as cached (`usage.prompt_tokens_details.
cached_tokens` = local + loaded tokens, vLLM's `num_cached_tokens`); `vllm:prefix_cache_hits_total`
counts the local hits only and `vllm:external_prefix_cache_hits_total` the loaded tokens, against
`vllm:external_prefix_cache_queries_total` (every admitted prompt token), as vLLM counts a
connector's hits.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.engine import SimRequest


class KVTransfer:
    """One replica's connector side (module docstring); `address()` is its host:port."""

    def __init__(self, config: SimConfig, address: Callable[[], str]) -> None:
        self.config = config
        self.connector = config.kv_connector
        self.engine_id = uuid.uuid4().hex
        self._address = address
        self._dir = Path(config.kv_shared_storage_path) if config.kv_shared_storage_path else None
        self._saves = config.kv_role in ("kv_producer", "kv_both")
        self._loads = config.kv_role in ("kv_consumer", "kv_both")

    async def prepare(self, req: SimRequest, params: Mapping[str, Any] | None) -> bool:
        """Before the request is queued: what it loads (`req.external_blocks`); True when its answer
        is to carry kv_transfer_params for a remote decode (the prompt's blocks are then kept)."""
        if self.connector == "nixl" and params:
            ids = params.get("remote_block_ids")
            if params.get("do_remote_prefill") and isinstance(ids, list):
                req.external_blocks = len(ids)
            if params.get("do_remote_decode"):
                req.keep_block_ids = True
                return True
        elif self.connector == "shared-storage" and self._loads and req.prompt_hashes:
            req.external_blocks = await asyncio.to_thread(self._stored_run, req.prompt_hashes)
        return False

    async def finish(self, req: SimRequest) -> None:
        """After the request finished: a producer's blocks to the shared storage."""
        if self.connector == "shared-storage" and self._saves and req.finished and req.prompt_hashes:
            await asyncio.to_thread(self._store, req.prompt_hashes)

    def answer_params(self, req: SimRequest, request_id: str) -> dict[str, Any]:
        """The `kv_transfer_params` of a prefill's answer (nixl)."""
        host, _, port = self._address().rpartition(":")
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(req.block_ids),
                "remote_engine_id": self.engine_id, "remote_request_id": request_id,
                "remote_host": host.strip("[]"), "remote_port": int(port), "tp_size": 1}

    def _stored_run(self, hashes: Sequence[int]) -> int:
        assert self._dir is not None
        n = 0
        for h in hashes:
            if not (self._dir / f"{h:016x}").exists():
                break
            n += 1
        return n

    def _store(self, hashes: Sequence[int]) -> None:
        assert self._dir is not None
        self._dir.mkdir(parents=True, exist_ok=True)
        for h in hashes:
            fd = os.open(self._dir / f"{h:016x}", os.O_CREAT | os.O_WRONLY, 0o644)
            os.close(fd)
