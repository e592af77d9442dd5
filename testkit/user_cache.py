"""The project's cache outside the repository, shared by everything that builds or installs once.

`cache_dir(*parts)`: `$PREFIX_EPP_CACHE`, else `$XDG_CACHE_HOME/prefix-epp`, else
`~/.cache/prefix-epp` (what bench/peers/build.sh uses too), joined with `parts`.
`locked(path)`: an exclusive flock on `path` (created with its parents) for the `with` body, so
concurrent builders of one cached item wait for each other instead of racing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    base = os.environ.get("PREFIX_EPP_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prefix-epp")
    return Path(base).joinpath(*parts)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
