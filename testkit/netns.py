"""A private network namespace for one test rig, and commands run in a private mount namespace.

Why: the kube-apiserver refuses loopback addresses in EndpointSlices, and pods need addresses of
their own (10.244.0.x) that several processes can bind on the same port, as pods do. A fresh
network namespace holds only its own loopback device, so the rig adds those addresses there and
nothing it binds can meet another test's ports; fixed ports that a program does not let us change
(Envoy Gateway's xDS port 18000, its health port 8081) cannot collide either.

How: `PrivateNetwork` moves the *calling thread* into a new network namespace (unshare(2) with
CLONE_NEWNET affects only the calling thread), brings `lo` up and adds addresses with `ip`. Every
process that thread starts inherits the namespace, and sockets it opens live there; `close()`
moves the thread back (setns(2) to the namespace it came from). Threads started before keep the
old namespace. The namespace disappears with its last process. Needs CAP_SYS_ADMIN (root).

`in_mount_namespace(argv, binds)` wraps a command so it runs in a private mount namespace with
bind mounts (`unshare -m`, then `mount --bind`, then `exec`): the process keeps its PID, so
stopping it by PID stops the real program. Envoy Gateway reads its certificates from the fixed
path /certs; Envoy resolves Service names through a hosts file.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NamespaceUnavailable(RuntimeError):
    """The kernel refused a new namespace (no CAP_SYS_ADMIN, or namespaces disabled)."""


class PrivateNetwork:
    """The calling thread's own network namespace, with `lo` up and extra addresses on it."""

    def __init__(self) -> None:
        self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        if _libc.unshare(CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            os.close(self._home)
            raise NamespaceUnavailable(f"unshare(CLONE_NEWNET): {os.strerror(err)} (the rig needs root)")
        self._closed = False
        self.ip("link", "set", "lo", "up")

    @staticmethod
    def ip(*args: str) -> None:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")

    def add_address(self, address: str) -> str:
        """Put `address` (IPv4, /32) on the namespace's loopback device; returns it."""
        self.ip("addr", "add", f"{address}/32", "dev", "lo")
        return address

    def close(self) -> None:
        """Move the calling thread back to the namespace it came from."""
        if self._closed:
            return
        self._closed = True
        if _libc.setns(self._home, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back to the original network namespace")
        os.close(self._home)


def in_mount_namespace(argv: Sequence[str], binds: Sequence[tuple[Path, Path]]) -> list[str]:
    """argv that runs `argv` in a private mount namespace with each (source, target) bind-mounted.

    A missing target directory (e.g. /certs) is created first; it stays, empty, outside the
    namespace: an empty mount point.
    """
    steps = []
    for source, target in binds:
        if source.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        steps.append(f"mount --bind {shlex.quote(str(source))} {shlex.quote(str(target))}")
    script = " && ".join([*steps, 'exec "$@"'])
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]
