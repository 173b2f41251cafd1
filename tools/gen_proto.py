"""Generate the Python stubs of proto/ into vgpu/v1/ (messages, gRPC services and .pyi).

The generated files are committed; tests/test_proto_drift.py regenerates them into a temporary
directory and fails when they differ, so a .proto change without a regeneration cannot land.

    python tools/gen_proto.py            # write into the repository
    python tools/gen_proto.py --out DIR  # write into DIR (DIR/vgpu/v1/...)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def proto_files() -> list[Path]:
    """Every .proto under proto/, sorted so generation order is stable."""
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out: Path) -> None:
    """Run protoc (from grpcio-tools) over every .proto file, writing under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *files,
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    args = parser.parse_args()
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
