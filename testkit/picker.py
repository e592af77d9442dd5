"""The picker as a real process for end-to-end tests, and its /metrics read back.

- `picker_for(tmp, endpoints, *flags)`: a `Picker` (not started) serving `endpoints` statically
  on three free ports (ext_proc, gRPC health, metrics), plaintext unless `secure`, bound to
  127.0.0.1; its log goes to `tmp/<name>.log`.
- `Picker.start()` runs `python -m extproc serve ...` and returns once the readiness service
  answers SERVING (`wait_ready`); `Picker.stop()` stops it (TERM, then KILL).
- `scrape(picker)`: every sample of its /metrics as {(name, sorted labels): value};
  `value(samples, name, **labels)` reads one (0 when absent); `until(picker, predicate)` scrapes
  until `predicate(samples)` holds or the timeout passes.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from extproc.pb import health_pb2, health_pb2_grpc
from testkit.procs import Proc, free_ports, prefix_epp

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class Picker:
    grpc_port: int
    health_port: int
    metrics_port: int
    args: list[str]
    log: Path
    proc: Proc | None = None

    def start(self) -> None:
        self.proc = Proc(self.args, self.log)
        wait_ready(self.health_port, self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None


def wait_ready(health_port: int, proc: Proc, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"picker exited:\n{proc.log_text()[-3000:]}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=0.5).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"picker not ready:\n{proc.log_text()[-3000:]}")


def picker_for(tmp: Path, endpoints: list[str], *extra: str, secure: bool = False, name: str = "picker") -> Picker:
    grpc_port, health_port, metrics_port = free_ports(3)
    args = prefix_epp(
        "serve", "--endpoints", ",".join(endpoints), "--grpc-port", str(grpc_port),
        "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port),
        f"--secure-serving={'true' if secure else 'false'}", "--bind-address", "127.0.0.1", *extra,
    )
    return Picker(grpc_port, health_port, metrics_port, args, tmp / f"{name}.log")


def scrape(picker: Picker) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{picker.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def until(picker: Picker, predicate: object, timeout: float = 10.0) -> Samples:
    """Scrape until `predicate(samples)` (a callable) is true; TimeoutError with the picker's log after `timeout`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        samples = await asyncio.to_thread(scrape, picker)
        if callable(predicate) and predicate(samples):
            return samples
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"picker metrics never satisfied the condition:\n{picker.proc.log_text()[-3000:]}"
                               if picker.proc else "picker not running")
        await asyncio.sleep(0.05)
