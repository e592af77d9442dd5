"""versions.env at the repository root, parsed: the external versions the deployment pins.

The file is plain `KEY=value` lines (comments and blank lines allowed) so that bash can source it
(scripts/kind-up.sh) and this module can read it without a shell.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from testkit.helm import REPO_ROOT

PATH = REPO_ROOT / "versions.env"
_LINE = re.compile(r"^([A-Z][A-Z0-9_]*)=(\S+)$")


def parse(path: Path = PATH) -> dict[str, str]:
    out: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"{path.name}:{number}: not a KEY=value line: {raw!r}")
        out[match.group(1)] = match.group(2)
    return out


def semver(version: str) -> tuple[int, int, int]:
    match = re.fullmatch(r"v(\d+)\.(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a release version vX.Y.Z: {version!r}")
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


@dataclass(frozen=True)
class Versions:
    eg: str
    eg_min: str
    eg_verified_tls_min: str
    gie: str
    gie_min: str
    llmd_router: str
    kind_min: str
    kind_node_image: str

    @classmethod
    def load(cls, path: Path = PATH) -> Versions:
        v = parse(path)
        return cls(eg=v["EG_VERSION"], eg_min=v["EG_MIN_VERSION"], eg_verified_tls_min=v["EG_VERIFIED_TLS_MIN_VERSION"],
                   gie=v["GIE_VERSION"], gie_min=v["GIE_MIN_VERSION"], llmd_router=v["LLMD_ROUTER_VERSION"],
                   kind_min=v["KIND_MIN_VERSION"], kind_node_image=v["KIND_NODE_IMAGE"])


VERSIONS = Versions.load()
