"""The committed stubs in vgpu/v1 must be exactly what tools/gen_proto.py makes of proto/.

No skips: grpcio-tools and mypy-protobuf both come with the dev extra that `make` installs, so an
environment without them fails here with the reason instead of letting drift through unchecked."""

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
    gen = _load_generator()  # an ImportError here: grpcio-tools is missing (pip install -e '.[dev]')
    gen.generate(tmp_path)  # PluginMissing here: mypy-protobuf is missing, with the same advice
    fresh = sorted(p.relative_to(tmp_path) for p in (tmp_path / "vgpu" / "v1").glob("*_pb2*"))
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "vgpu" / "v1").glob("*_pb2*"))
    assert fresh == committed, "generated file set differs: run `make proto` and commit"
    for rel in fresh:
        assert (tmp_path / rel).read_bytes() == (ROOT / rel).read_bytes(), (
            f"{rel} drifted: run `make proto` (with the grpcio-tools and mypy-protobuf pinned in the dev extra)"
        )


def test_missing_grpc_stub_plugin_fails_before_writing(tmp_path: Path) -> None:
    gen = _load_generator()
    out = tmp_path / "out"
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    with pytest.raises(gen.PluginMissing, match=r"protoc-gen-mypy_grpc not found in .*mypy-protobuf"):
        gen.generate(out, bin_dir=empty_bin)
    assert not out.exists()


def test_main_reports_missing_plugin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gen = _load_generator()
    (tmp_path / "bin").mkdir()
    code = gen.main(["--out", str(tmp_path / "out"), "--bin-dir", str(tmp_path / "bin")])
    assert code == 1
    assert "protoc-gen-mypy_grpc not found" in capsys.readouterr().err


def test_every_proto_has_stubs() -> None:
    for proto in (ROOT / "proto").rglob("*.proto"):
        stem = proto.relative_to(ROOT / "proto").with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi"):
            assert (ROOT / f"{stem}{suffix}").exists(), f"{stem}{suffix} missing"
