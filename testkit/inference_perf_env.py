"""inference-perf, the field's load generator, in its own environment: built once and cached.

`python -m testkit.inference_perf_env` prints the environment's directory and builds it where
missing: a virtual environment of a Python >= 3.12 interpreter (inference-perf's floor; the
project's own venv may be older) holding PyPI's `inference-perf==VERSION` and its dependencies.
The interpreter is `INFERENCE_PERF_PYTHON` when set, else the first of `python3.13`,
`python3.12` on PATH (pyenv's shims included) or under ~/.pyenv/versions/.

`tokenizer_dir()` writes the tokenizer the runs count with (`tokenizer/` beside the versions): a
byte-level BPE over printable ASCII, newline and tab with no merges, so one character is one
token and any token sequence decodes to text that encodes back to the same tokens. inference-perf
builds prompts of an exact token length by decoding random token ids and re-counting; with a real
model's merges (the tiny model's) 1,200- and 6,000-token prompts do not converge in its 20
attempts, and it aborts.

Cache: `${PREFIX_EPP_CACHE:-${XDG_CACHE_HOME:-~/.cache}/prefix-epp}/inference-perf/<VERSION>/`,
outside the repository, keyed by the version; a lock file serialises concurrent builders, and a
build counts once its BUILD-INFO is written (an interrupted one is started over). Nothing is
downloaded at run time: inference-perf is pointed at a local tokenizer directory
(`bench.lib.inference_perf`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testkit.user_cache import cache_dir, locked

VERSION = "0.7.0"
MIN_PYTHON = (3, 12)


class InferencePerfEnvError(RuntimeError):
    """The environment could not be built (no Python >= 3.12, no package registry, a failed install)."""


@dataclass(frozen=True)
class InferencePerfEnv:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def command(self) -> Path:
        return self.root / "venv" / "bin" / "inference-perf"


def cache_root() -> Path:
    return cache_dir("inference-perf")


def _version_of(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = out.stdout.split()
    return (int(parts[0]), int(parts[1])) if out.returncode == 0 and len(parts) == 2 else None


def find_python() -> str:
    """An interpreter of Python >= 3.12 (module docstring), or InferencePerfEnvError."""
    candidates = [os.environ["INFERENCE_PERF_PYTHON"]] if os.environ.get("INFERENCE_PERF_PYTHON") else []
    candidates += [p for name in ("python3.13", "python3.12") if (p := shutil.which(name))]
    candidates += sorted(str(p) for p in (Path.home() / ".pyenv" / "versions").glob("3.1[2-9]*/bin/python3"))
    for python in candidates:
        version = _version_of(python)
        if version is not None and version >= MIN_PYTHON:
            return python
    raise InferencePerfEnvError("inference-perf needs Python >= 3.12 and none was found "
                                "(set INFERENCE_PERF_PYTHON, or install one, e.g. with pyenv)")


def _run(args: list[str], log: Path) -> None:
    with open(log, "ab") as out:
        proc = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise InferencePerfEnvError(f"{' '.join(args[:4])} ... failed ({proc.returncode}):\n{tail}")


def built() -> InferencePerfEnv | None:
    """The environment if it is already built here, else None (builds nothing)."""
    root = cache_root() / VERSION
    return InferencePerfEnv(root) if (root / "BUILD-INFO").is_file() else None


def ensure() -> InferencePerfEnv:
    """The environment, built where missing (a minute or two the first time, then instant)."""
    env = built()
    if env is not None:
        return env
    root = cache_root() / VERSION
    with locked(cache_root() / ".lock"):
        if (root / "BUILD-INFO").is_file():
            return InferencePerfEnv(root)
        python = find_python()
        print(f"testkit.inference_perf_env: installing inference-perf {VERSION} (first time)", file=sys.stderr)
        if root.exists():
            shutil.rmtree(root)  # an interrupted build
        root.mkdir(parents=True)
        log, started = root / "build.log", time.monotonic()
        _run([python, "-m", "venv", str(root / "venv")], log)
        env = InferencePerfEnv(root)
        _run([str(env.python), "-m", "pip", "-q", "--disable-pip-version-check", "install", "--no-cache-dir",
              f"inference-perf=={VERSION}"], log)
        (root / "BUILD-INFO").write_text(
            f"inference-perf: {VERSION}\npython: {_version_of(python)}\ninterpreter: {python}\n"
            f"built in {time.monotonic() - started:.0f} s\n")
    return env


def _byte_char(b: int) -> str:
    """GPT-2's byte-to-character map (byte-level BPE), for the bytes used here."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


def tokenizer_dir() -> Path:
    """tokenizer.json + tokenizer_config.json of the ASCII byte-level tokenizer (module docstring)."""
    out = cache_root() / "tokenizer-ascii-v1"
    if (out / "tokenizer_config.json").is_file():
        return out
    alphabet = [9, 10, *range(32, 127)]
    vocab = {_byte_char(b): i for i, b in enumerate(alphabet)}
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    doc: dict[str, Any] = {
           "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
           "pre_tokenizer": level, "post_processor": None, "decoder": level,
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                     "vocab": vocab, "merges": []}}
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tokenizer.json").write_text(json.dumps(doc))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
              "clean_up_tokenization_spaces": False}
    (tmp / "tokenizer_config.json").write_text(json.dumps(config))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def main() -> int:
    try:
        env = ensure()
    except InferencePerfEnvError as exc:
        print(f"testkit.inference_perf_env: {exc}", file=sys.stderr)
        return 1
    print(env.root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
