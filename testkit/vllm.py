"""Real vLLM engines (the CPU build) on loopback addresses: started, waited for, restarted, stopped.

`engines(tmp, n)` starts n `vllm serve` processes of the tiny model (testkit/vllm_env.py), the i-th
on 127.0.0.<i + 2> with free ports, and yields them once each answers GET /health; every process
is stopped by its process group when the block ends. A process that exits while starting fails
at once with the end of its log. Each engine is started as the rig of the real-vLLM tests and
benchmark needs it:
- `--block-size 32` (the CPU attention backend needs a multiple of 32), `--enforce-eager` (no
  graph compilation: ~20-50 s to healthy), `--max-model-len 8192`;
- `--kv-cache-memory-bytes 16M`: 512 blocks of 32 tokens, small enough that a test evicts;
- `--enable-prompt-tokens-details`: `usage.prompt_tokens_details.cached_tokens` in every answer;
- KV events on a ZeroMQ PUB socket and a replay ROUTER socket. Their endpoints are `tcp://*:PORT`:
  an endpoint that names a host makes vLLM's PUB socket connect instead of bind, so each engine
  takes its own ports, and the picker is told them per endpoint (`Engine.spec`). The topic is
  `kv@<address:port>@<served model name>` (vLLM's default is empty; llm-d's router subscribes
  to "kv@" and reads the model from the topic), as the simulator's;
- `--enable-scale-out`: vLLM's render routes (`/v1/completions/render`,
  `/v1/chat/completions/render`; without it they answer 403), which llm-d's router tokenizes with;
- one core each (`VLLM_CPU_OMP_THREADS_BIND`, round robin over the machine's cores), TMPDIR and
  VLLM_CACHE_ROOT under the test's directory, no usage reporting, no hub access;
- `VLLM_SERVER_DEV_MODE=1`, for POST /reset_prefix_cache (a benchmark starts every router on cold
  caches).
`Engine.nice` (`engines(..., nice=N)`) starts the engine under `nice -n N`, which every process it
spawns inherits: the benchmark runs its engines below the routers' priority, so a router's
exchange does not wait for a core an engine holds. `Engine.extra_args` go after the rig's flags
(a benchmark workload's `--max-num-seqs`; `restart` picks up a change).
`engines(..., dp_size=N)` starts each engine with `--data-parallel-size N` and one API server (vLLM's
internal balancer: one HTTP port, N engine processes, one core each; the header `X-data-parallel-rank: r`
pins a request to rank r), whose rank r publishes on `events_port + r` and replays on
`replay_port + r`; `rank_ports` gives each rank a port of its own, as a pool's targetPorts list them.
`engines(..., engine_args=[kv_transfer_args("kv_producer", d), kv_transfer_args("kv_consumer", d)])`
starts a prefill/decode pair over vLLM's ExampleConnector on the directory d.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from extproc.scraping.prom_text import samples
from testkit.procs import Proc, consecutive_free_ports, free_ports
from testkit.vllm_env import MODEL_NAME, VllmEnv, ensure

BLOCK_SIZE = 32
KV_CACHE_BYTES = 16 * 1024 * 1024
NUM_BLOCKS = 512  # what vLLM makes of KV_CACHE_BYTES for the tiny model (2 layers, 2 KV heads of 64, bf16)
MAX_MODEL_LEN = 8192
START_TIMEOUT_S = 240.0
# Per connection, not forwarded by a proxy (RFC 9110 7.6.1), and the body's length and encoding,
# which aiohttp sets again for the body it sends.
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host",
                         "content-encoding", "upgrade", "te", "trailer", "proxy-connection"})


@dataclass
class Engine:
    """One `vllm serve` process and its addresses."""

    env: VllmEnv
    address: str
    port: int
    events_port: int
    replay_port: int
    workdir: Path
    core: int
    served_model_name: str = MODEL_NAME
    proc: Proc | None = None
    starts: int = field(default=0)
    nice: int = 0  # the process's niceness (module docstring); 0: the caller's
    extra_args: tuple[str, ...] = ()  # `vllm serve` flags after the rig's
    dp_size: int = 1  # --data-parallel-size (module docstring)
    short_tmp: Path | None = None  # TMPDIR with data-parallel ranks (`environ`), removed by `stop`

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    @property
    def key(self) -> str:
        """The endpoint as the picker and Envoy name it."""
        return f"{self.address}:{self.port}"

    @property
    def events(self) -> str:
        """The KV-event and replay sockets, "tcp://events@tcp://replay" (`bench.lib.routers.Pool.kv_events`)."""
        return f"tcp://{self.address}:{self.events_port}@tcp://{self.address}:{self.replay_port}"

    @property
    def topic(self) -> str:
        return f"kv@{self.key}@{self.served_model_name}"

    @property
    def spec(self) -> str:
        """`--endpoints` entry with the engine's KV-event and replay sockets."""
        return f"{self.key}@{self.events}"

    def args(self) -> list[str]:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events_port}",
                  "replay_endpoint": f"tcp://*:{self.replay_port}", "topic": self.topic}
        return [str(self.env.vllm), "serve", str(self.env.model), "--served-model-name", self.served_model_name,
                "--host", self.address, "--port", str(self.port), "--block-size", str(BLOCK_SIZE),
                "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
                "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enable-prompt-tokens-details",
                "--kv-events-config", json.dumps(events), "--disable-uvicorn-access-log",
                "--enable-scale-out",  # the render endpoints (/v1/*/render): the tokens the engine executes
                # One API server, not one per rank (vLLM's default): with several, vLLM's /metrics is
                # prometheus_client's multiprocess collection, which renders nothing for the
                # picker's `?name[]=` filtered scrape.
                *(["--data-parallel-size", str(self.dp_size), "--api-server-count", "1"] if self.dp_size > 1 else [])]

    def environ(self) -> dict[str, str]:
        tmp, cache = self.workdir / "tmp", self.workdir / "cache"
        if self.dp_size > 1:
            # Its engine processes talk over IPC sockets in TMPDIR, whose paths must fit AF_UNIX's
            # 108 bytes: a test's own directory does not.
            self.short_tmp = self.short_tmp or Path(tempfile.mkdtemp(prefix="vllm-dp-"))
            tmp = self.short_tmp
        tmp.mkdir(parents=True, exist_ok=True)
        cache.mkdir(parents=True, exist_ok=True)
        return {"TMPDIR": str(tmp), "VLLM_CACHE_ROOT": str(cache), "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "VLLM_CPU_OMP_THREADS_BIND": self.cores(), "VLLM_SERVER_DEV_MODE": "1",
                "HOME": str(self.workdir)}

    def cores(self) -> str:
        """VLLM_CPU_OMP_THREADS_BIND: a core per rank ("0|1"), round robin from `core`."""
        n = os.cpu_count() or 1
        return "|".join(str((self.core + r) % n) for r in range(self.dp_size))

    def command(self) -> list[str]:
        """What `launch` runs: `args` and `extra_args`, under `nice -n` when `nice` is set."""
        argv = [*self.args(), *self.extra_args]
        return ["nice", "-n", str(self.nice), *argv] if self.nice else argv

    def launch(self) -> None:
        self.starts += 1
        self.proc = Proc(self.command(), self.workdir / f"vllm-{self.starts}.log", env=self.environ())

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise RuntimeError(f"vllm serve on {self.key} exited:\n{self.proc.log_text()[-4000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve on {self.key} not healthy after {timeout:.0f} s:\n"
                           f"{self.proc.log_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout=20.0)
            self.proc = None
        if self.short_tmp is not None:
            shutil.rmtree(self.short_tmp, ignore_errors=True)
            self.short_tmp = None

    def restart(self) -> None:
        """A new engine process on the same addresses: an empty cache and a new event sequence."""
        self.stop()
        self.launch()
        self.wait_healthy()

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as resp:
            body: bytes = resp.read()
            return body

    def post(self, path: str, payload: dict[str, Any] | None = None) -> Any:
        data = json.dumps(payload or {}).encode()
        req = urllib.request.Request(f"{self.url}{path}", data, {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"POST {path} on {self.key}: {exc.code} {exc.read()[:500]!r}") from None
        return json.loads(body) if body.strip() else None

    def reset_prefix_cache(self) -> None:
        self.post("/reset_prefix_cache")

    def counter(self, name: str) -> float:
        """Sum of a metric's samples in the engine's /metrics (e.g. `vllm:prefix_cache_hits_total`)."""
        return metric_total(self.get("/metrics"), name)


def kv_transfer_args(role: str, shared: Path) -> tuple[str, ...]:
    """`vllm serve` flags of one side of a prefill/decode pair over vLLM's ExampleConnector: `role`
    kv_producer or kv_consumer, both on the directory `shared`. Chunked prefill breaks the pair on
    the CPU build (a consumer loading a prompt longer than one chunk died with "shape mismatch:
    value tensor of shape [2048, 2, 128] cannot be broadcast to indexing result of shape
    [4160, 2, 128]"), so each engine takes a whole prompt in one step: --max-num-batched-tokens
    8192, the rig's --max-model-len."""
    config = {"kv_connector": "ExampleConnector", "kv_role": role,
              "kv_connector_extra_config": {"shared_storage_path": str(shared)}}
    return ("--kv-transfer-config", json.dumps(config), "--max-num-batched-tokens", str(MAX_MODEL_LEN))


def metric_total(exposition: bytes, name: str) -> float:
    """Sum of the samples of `name` in a Prometheus exposition, read as the picker's scraper reads it."""
    return sum(value for _, value in samples(exposition, name.encode(), want_labels=False))


@contextlib.contextmanager
def engines(tmp: Path, n: int = 2, served_model_name: str = MODEL_NAME, nice: int = 0,
            extra_args: tuple[str, ...] = (), dp_size: int = 1,
            engine_args: Sequence[tuple[str, ...]] = ()) -> Iterator[list[Engine]]:
    """n engines started side by side, healthy on entry, stopped on exit, serving the model as
    `served_model_name` (the tests' MODEL_NAME; the benchmark's requests name another), at
    niceness `nice` (module docstring), each with `extra_args` (`Engine.extra_args`), then the i-th
    with `engine_args[i]` (a prefill/decode pair's roles: `kv_transfer_args`), and `dp_size`
    data-parallel ranks."""
    env = ensure()
    cores = os.cpu_count() or 1
    out = []
    # KV-event and replay ports consecutive across the engines and their ranks: a subscriber that
    # dials one base port plus each engine's rank (llm-d's precise-prefix producer) reaches every
    # engine, and no rank's publisher lands on a replay port.
    ranks = n * dp_size
    events_base = consecutive_free_ports(2 * ranks)
    http_ports = [p for p in free_ports(3 * n + 2 * ranks) if not events_base <= p < events_base + 2 * ranks][:n]
    for i in range(n):
        port, events, replay = http_ports[i], events_base + i * dp_size, events_base + ranks + i * dp_size
        workdir = tmp / f"vllm{i}"
        workdir.mkdir(parents=True, exist_ok=True)
        out.append(Engine(env, f"127.0.0.{i + 2}", port, events, replay, workdir, core=i * dp_size % cores,
                          served_model_name=served_model_name, nice=nice,
                          extra_args=(*extra_args, *(engine_args[i] if i < len(engine_args) else ())),
                          dp_size=dp_size))
    try:
        for engine in out:
            engine.launch()
        for engine in out:
            engine.wait_healthy()
        yield out
    finally:
        for engine in out:
            engine.stop()


RANK = web.AppKey("rank", int)


@contextlib.asynccontextmanager
async def rank_ports(engine: Engine, ports: list[int]) -> AsyncIterator[None]:
    """HTTP on `engine.address`:ports[r] forwarded to the engine with `X-data-parallel-rank: r`:
    each rank of a `--data-parallel-size` engine reachable on a port of its own, as llm-d's
    sidecar gives each rank one (its proxies on the base port + r); served on the running loop."""
    async def forward(request: web.Request) -> web.Response:
        rank = request.app[RANK]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        headers["X-data-parallel-rank"] = str(rank)
        url = URL(f"{engine.url}{request.raw_path}", encoded=True)  # the query as sent (the scraper's name[]=)
        async with session.request(request.method, url, headers=headers, data=await request.read()) as reply:
            body = await reply.read()
            return web.Response(status=reply.status, body=body,
                                headers={k: v for k, v in reply.headers.items() if k.lower() not in HOP_HEADERS})

    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
    runners = []
    try:
        for rank, port in enumerate(ports):
            app = web.Application()
            app[RANK] = rank
            app.router.add_route("*", "/{tail:.*}", forward)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, engine.address, port).start()
        yield
    finally:
        for runner in runners:
            await runner.cleanup()
        await session.close()
