"""The container image, built for real by `make image` (scripts/build-image.sh: podman, chroot
isolation, a debootstrapped Python base) before `make test` runs pytest.

Containers cannot be started on the project's machines, so the image is checked from its own
file system: `podman image mount` (read-only), then, in a private mount namespace, a read-only
bind of it with a tmpfs on /tmp and the host's /dev and /proc, entered with
`chroot --userspec=65532:65532` and the image's own environment. From there the picker and the
simulator start and answer their health checks, and a request through real Envoy (on the host)
is routed by the picker to the simulator. Also checked: the image's user, entrypoint and
command, no compiler and no pip cache inside, nothing writable for its user outside /tmp.

A missing image, podman or util-linux tool fails the test (it never skips): run `make image`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shlex
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from extproc.pb import health_pb2, health_pb2_grpc
from testkit.envoy import run_envoy
from testkit.helm import REPO_ROOT
from testkit.http_client import completion, post
from testkit.procs import Proc, free_ports, wait_for_port

pytestmark = pytest.mark.e2e

# The tag scripts/build-image.sh gives this checkout's image.
IMAGE = f"localhost/prefix-epp:test-{hashlib.sha256(str(REPO_ROOT).encode()).hexdigest()[:12]}"
UID = 65532
COMPILERS = ("gcc", "cc", "c++", "g++", "clang", "x86_64-linux-gnu-gcc-12", "ld", "as", "make")


def run(*args: str) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"{shlex.join(args)} failed ({proc.returncode}): {proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def image() -> dict[str, Any]:
    for tool in ("podman", "unshare", "chroot", "mount"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not found: run `make image` (it installs podman) on a machine with apt-get")
    proc = subprocess.run(["podman", "image", "inspect", IMAGE], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.fail(f"image {IMAGE} not built: run `make image` ({proc.stderr.strip()})")
    info: dict[str, Any] = json.loads(proc.stdout)[0]
    return info


@pytest.fixture(scope="module")
def rootfs(image: dict[str, Any]) -> Iterator[Path]:
    path = Path(run("podman", "image", "mount", IMAGE).strip())
    try:
        yield path
    finally:
        subprocess.run(["podman", "image", "unmount", IMAGE], capture_output=True, check=False)


def in_image(rootfs: Path, image: dict[str, Any], argv: list[str]) -> list[str]:
    """argv that runs `argv` from the image: read-only root, tmpfs /tmp, UID/GID 65532, the
    image's environment only."""
    env = " ".join(shlex.quote(e) for e in image["Config"]["Env"])
    script = (
        'set -e; root=$(mktemp -d); mount --bind "$1" "$root"; mount -o remount,bind,ro "$root"; '
        'mount -t tmpfs -o size=64m,mode=1777 tmpfs "$root/tmp"; mount --rbind /dev "$root/dev"; '
        'mount -t proc proc "$root/proc"; shift; '
        f'exec chroot --userspec={UID}:{UID} "$root" /usr/bin/env -i {env} "$@"'
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(rootfs), *argv]


def test_image_config(image: dict[str, Any]) -> None:
    config = image["Config"]
    assert config["User"] == f"{UID}:{UID}"
    assert config["Entrypoint"] == ["prefix-epp"]
    assert config["Cmd"][0] == "serve"
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["HOME"] == "/tmp" and env["PYTHONDONTWRITEBYTECODE"] == "1"


def test_image_holds_the_current_sources(rootfs: Path) -> None:
    """The installed package is this checkout's (a stale layer cache would hide changes)."""
    [site] = list((rootfs / "opt" / "prefix-epp" / "lib").glob("python3*/site-packages"))
    sources = sorted(p.relative_to(REPO_ROOT) for pkg in ("extproc", "prefix_epp_sim")
                     for p in (REPO_ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)
    assert sources
    differing = [str(rel) for rel in sources if (site / rel).read_bytes() != (REPO_ROOT / rel).read_bytes()]
    assert not differing, f"the image holds other versions of {differing[:5]}: run `make image`"


def test_no_compiler_and_no_pip_cache(rootfs: Path) -> None:
    for directory in ("usr/bin", "usr/local/bin", "opt/venv/bin", "opt/prefix-epp/bin"):
        present = [c for c in COMPILERS if (rootfs / directory / c).exists()]
        assert not present, f"/{directory} holds {present}"
    caches = [p for p in (rootfs / "root" / ".cache", rootfs / "tmp" / ".cache") if p.exists()]
    caches += [p for p in rootfs.glob("**/.cache/pip") if p.is_dir()]
    assert not caches, caches
    assert not list((rootfs / "tmp").iterdir()), "/tmp is not empty"
    wheels = list((rootfs / "opt").rglob("*.whl")) + list(rootfs.glob("wheels/*")) + list(rootfs.glob("src/*"))
    assert not wheels, wheels[:5]


def test_root_is_read_only_and_not_writable_by_the_user(rootfs: Path, image: dict[str, Any]) -> None:
    probe = ("import os, sys\n"
             "print(os.getuid(), os.getgid())\n"
             "for path in ('/x', '/opt/prefix-epp/x', '/etc/x'):\n"
             "    try:\n"
             "        open(path, 'w')\n"
             "        sys.exit('wrote ' + path)\n"
             "    except OSError as exc:\n"
             "        print(path, exc.errno)\n"
             "open('/tmp/ok', 'w').write('tmp is writable')\n")
    out = run(*in_image(rootfs, image, ["python3", "-c", probe])).split("\n")
    assert out[0] == f"{UID} {UID}"
    assert all(line.split()[-1] in ("30", "13") for line in out[1:4]), out  # EROFS / EACCES


@contextlib.contextmanager
def started(rootfs: Path, image: dict[str, Any], tmp: Path, name: str, argv: list[str], port: int) -> Iterator[Proc]:
    proc = Proc(in_image(rootfs, image, argv), tmp / f"{name}.log")
    try:
        try:
            wait_for_port(port, timeout=30, proc=proc.popen)  # an exit fails at once
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"{name} did not start: {exc}\n{proc.log_text()[-3000:]}") from None
        yield proc
    finally:
        proc.stop()


async def test_picker_and_simulator_start_from_the_image_and_route(
        rootfs: Path, image: dict[str, Any], tmp_path: Path) -> None:
    sim_port, events_port, replay_port, grpc_port, health_port, metrics_port = free_ports(6)
    sim = ["prefix-epp", "sim", "--host", "127.0.0.1", "--port", str(sim_port), "--model", "demo",
           "--kv-events-port-base", str(events_port), "--kv-events-replay-port-base", str(replay_port)]
    picker = ["prefix-epp", "serve", "--endpoints", f"127.0.0.1:{sim_port}", "--bind-address", "127.0.0.1",
              "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
              "--metrics-port", str(metrics_port)]  # TLS on: the image's default
    with started(rootfs, image, tmp_path, "sim", sim, sim_port), \
            started(rootfs, image, tmp_path, "picker", picker, health_port) as picker_proc:
        with urllib.request.urlopen(f"http://127.0.0.1:{sim_port}/health", timeout=5) as r:
            assert r.status == 200
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + 30
            status = None
            while status != health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
                status = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=10).status
                time.sleep(0.05)
            assert status == health_pb2.HealthCheckResponse.SERVING, picker_proc.log_text()
        wait_for_port(metrics_port, timeout=30)  # served after the gRPC ports open
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            assert b"prefix_epp" in r.read()
        with run_envoy(tmp_path, grpc_port, epp_tls=True) as (_, listen, _admin):
            async with aiohttp.ClientSession() as s:
                reply = await post(s, f"http://127.0.0.1:{listen}/v1/completions",
                                   {**completion("from the image"), "model": "demo", "max_tokens": 4})
        assert reply.status == 200, reply.body[:300]
        assert reply.json()["choices"], reply.body[:300]
        assert reply.served_by == f"127.0.0.1:{sim_port}"
        log = picker_proc.log_text()
    assert "picker started" in log and '"secure_serving":true' in log
