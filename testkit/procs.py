"""Start and stop real processes for tests: free ports, readiness waits, guaranteed cleanup.

Every helper binds or connects to 127.0.0.1 only. Processes are started in their own process
group and killed (TERM, then KILL) when the test ends, so nothing outlives the test session.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def _server_port_range() -> tuple[int, int]:
    """Ports below the kernel's ephemeral range: no outgoing connection ever takes one as its
    local port between our check and the server's bind (a port the kernel handed out as free,
    from that range, can be taken by any client's connect meanwhile)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return (10000, low - 1) if low > 12000 else (low - 2000, low - 1)


_PORTS = random.Random()


def _bind_free(socks: list[socket.socket]) -> None:
    low, high = _server_port_range()
    taken = {s.getsockname()[1] for s in socks}
    for _ in range(1000):
        port = _PORTS.randint(low, high)
        if port in taken:
            continue
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        socks.append(s)
        return
    raise RuntimeError(f"no free port in {low}-{high}")


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (see _server_port_range)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """Return n distinct free ports (held open together so they cannot collide)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            _bind_free(socks)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def consecutive_free_ports(n: int, attempts: int = 50) -> int:
    """First of n consecutive ports on 127.0.0.1 that were all free a moment ago (a peer that
    offsets one base port by each replica's rank, as llm-d's KV-event subscriber does, needs them)."""
    low, high = _server_port_range()
    for _ in range(attempts):
        base = _PORTS.randint(low, high - n + 1)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + n):
                    sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no {n} consecutive free ports in {low}-{high}")


def wait_for_port(port: int, host: str = "127.0.0.1", timeout: float = 15.0,
                  proc: subprocess.Popen[bytes] | None = None) -> None:
    """Block until something accepts TCP connections on host:port, or fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


async def until(cond: Callable[[], bool], timeout: float = 15.0) -> None:
    """Wait on the event loop until `cond()` holds; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.01)


class Proc:
    """A child process with its output captured to a log file, stopped on exit."""

    def __init__(self, args: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        full_env = dict(os.environ)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        if env:
            full_env.update(env)
        self.popen: subprocess.Popen[bytes] = subprocess.Popen(
            self.args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
            cwd=str(REPO_ROOT), start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 5.0) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=timeout)
        self._log.close()


@contextlib.contextmanager
def running(args: Sequence[str], log_path: Path, wait_port: int | None = None,
            env: dict[str, str] | None = None, timeout: float = 20.0) -> Iterator[Proc]:
    """Run a process for the duration of a with-block; optionally wait for its port."""
    proc = Proc(args, log_path, env)
    try:
        if wait_port is not None:
            try:
                wait_for_port(wait_port, timeout=timeout, proc=proc.popen)
            except Exception as exc:
                raise RuntimeError(f"{args[0]} failed to start: {exc}\n{proc.log_text()[-4000:]}") from exc
        yield proc
    finally:
        proc.stop()


def python_module(module: str, *args: str) -> list[str]:
    """argv to run a module with the test interpreter (the project venv)."""
    return [sys.executable, "-m", module, *args]


def prefix_epp(*args: str) -> list[str]:
    """argv to run the prefix-epp CLI with the test interpreter."""
    return python_module("extproc", *args)
