"""Generate the Python stubs of proto/ into vgpu/v1/ (messages, gRPC services and .pyi).

protoc (from grpcio-tools) writes the modules and the message stubs (`*_pb2.pyi`); the
`protoc-gen-mypy_grpc` plugin of mypy-protobuf writes the service stubs (`*_pb2_grpc.pyi`), so mypy
checks every stub, servicer and `add_*Servicer_to_server` we use. Both tools are pinned in the dev
extra: their output is compared byte for byte.

The generated files are committed; tests/test_proto_drift.py regenerates them into a temporary
directory and fails when they differ, so a .proto change without a regeneration cannot land.

    python tools/gen_proto.py            # write into the repository
    python tools/gen_proto.py --out DIR  # write into DIR (DIR/vgpu/v1/...)
    python tools/gen_proto.py --bin-dir DIR  # take protoc-gen-mypy_grpc from DIR
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
GRPC_STUB_PLUGIN = "protoc-gen-mypy_grpc"


class PluginMissing(RuntimeError):
    """The protoc plugin that types the gRPC services is not installed beside this Python."""


def find_plugin(name: str, bin_dir: Path) -> Path:
    """The protoc plugin executable `name` in `bin_dir`, where pip puts a package's console scripts
    (the venv's bin/ for the venv's Python). Raises PluginMissing saying how to install it."""
    found = shutil.which(name, path=str(bin_dir))
    if found is None:
        raise PluginMissing(
            f"{name} not found in {bin_dir}: it comes with mypy-protobuf, pinned in the dev extra;"
            " install it with `pip install -e '.[dev]'` (or `make venv`) and rerun"
        )
    return Path(found)


def proto_files() -> list[Path]:
    """Every .proto under proto/, sorted so generation order is stable."""
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out: Path, bin_dir: Path | None = None) -> None:
    """Run protoc (from grpcio-tools) with the mypy-protobuf gRPC plugin over every .proto file,
    writing under `out`. The plugin is looked up in `bin_dir` (default: the directory of this Python);
    PluginMissing is raised before anything is written when it is not there."""
    plugin = find_plugin(GRPC_STUB_PLUGIN, bin_dir if bin_dir is not None else Path(sys.executable).parent)
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
        f"--plugin={GRPC_STUB_PLUGIN}={plugin}",
        f"--mypy_grpc_out=quiet:{out}",  # quiet: no "Writing mypy to ..." line per file
        *files,
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    parser.add_argument(
        "--bin-dir", type=Path, default=None,
        help=f"where to find {GRPC_STUB_PLUGIN} (default: the directory of this Python)",
    )
    args = parser.parse_args(argv)
    try:
        generate(args.out, args.bin_dir)
    except PluginMissing as exc:
        print(f"gen_proto: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
