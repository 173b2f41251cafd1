"""The committed stubs in vgpu/v1 must be exactly what tools/gen_proto.py makes of proto/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_generator():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = module
    spec.loader.exec_module(module)
    return module


def test_generated_stubs_match_proto_sources(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    gen = _load_generator()
    gen.generate(tmp_path)
    fresh = sorted(p.relative_to(tmp_path) for p in (tmp_path / "vgpu" / "v1").glob("*_pb2*"))
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "vgpu" / "v1").glob("*_pb2*"))
    assert fresh == committed, "generated file set differs: run `make proto` and commit"
    for rel in fresh:
        assert (tmp_path / rel).read_bytes() == (ROOT / rel).read_bytes(), f"{rel} drifted: run `make proto`"


def test_every_proto_has_stubs() -> None:
    for proto in (ROOT / "proto").rglob("*.proto"):
        stem = proto.relative_to(ROOT / "proto").with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert (ROOT / f"{stem}{suffix}").exists(), f"{stem}{suffix} missing"
