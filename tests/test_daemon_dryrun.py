"""Dry run is the default on a real GPU (the nvml backend): the daemon says so at start, `vgpu available`
shows it, and nothing is written to the device until `server.dry_run = false`."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import structlog
from prometheus_client import CollectorRegistry

from vgpu import config
from vgpu import ctl as cli
from vgpu.daemon.serve import Daemon, SdNotifier
from vgpu.device.fake_pynvml import FakePynvml
from vgpu.device.nvml import NvmlBackend
from vgpu.device.sim import SimBackend

SHIPPED = Path(__file__).resolve().parent.parent / "systemd" / "vgpu.toml"


def test_the_default_is_dry_run_on_nvml_and_not_on_the_simulator() -> None:
    for cfg in (config.load(None, env={}), config.load(SHIPPED, env={})):
        assert cfg.server.dry_run is None  # unset: decided by the backend
        assert config.dry_run_of(cfg.server) is True  # the default backend is nvml
    assert config.dry_run_of(config.load(None, env={}, overrides={"server.backend": "sim:h100-80gb"}).server) is False
    told = config.load(None, env={"VGPU_SERVER_DRY_RUN": "false"})
    assert config.dry_run_of(told.server) is False


def _nvml_daemon(tmp_path: Path, **overrides: object) -> tuple[Daemon, SimBackend]:
    cfg = config.load(None, env={}, overrides={
        "server.socket": str(tmp_path / "v.sock"), "server.state_dir": str(tmp_path / "state"),
        "server.backend": "nvml", "metrics.port": 0, "server.grace_s": 0.0, **overrides,
    })
    sim = SimBackend(["h100-80gb"])
    backend = NvmlBackend(nvml=FakePynvml(sim))
    return Daemon(cfg, notifier=SdNotifier(env={}), registry=CollectorRegistry(), backend=backend), sim


async def _available(d: Daemon, tmp_path: Path, *extra: str) -> str:
    out = io.StringIO()
    rc = await asyncio.to_thread(cli.available_main, ["--socket", str(d.socket_path), *extra], "vgpu available",
                                 out=out, env={"XDG_CONFIG_HOME": str(tmp_path / "cfg")})
    assert rc == 0
    return out.getvalue()


async def test_nvml_daemon_starts_in_dry_run_and_says_so(tmp_path: Path) -> None:
    d, _sim = _nvml_daemon(tmp_path)
    with structlog.testing.capture_logs() as logs:
        await d.start()
    try:
        assert d.allocator.dry_run is True
        (line,) = [e for e in logs if e["event"] == "dry_run"]
        assert line["log_level"] == "warning" and "server.dry_run = false" in line["to_act"]
        assert [e["dry_run"] for e in logs if e["event"] == "serving"] == [True]
        text = await _available(d, tmp_path)
        assert text.startswith("dry run: ")
        assert json.loads(await _available(d, tmp_path, "--json"))["dry_run"] is True
    finally:
        await d.stop("test")


async def test_nvml_daemon_acts_when_told(tmp_path: Path) -> None:
    d, _sim = _nvml_daemon(tmp_path, **{"server.dry_run": False})
    with structlog.testing.capture_logs() as logs:
        await d.start()
    try:
        assert d.allocator.dry_run is False
        assert not [e for e in logs if e["event"] == "dry_run"]
        assert "dry run" not in await _available(d, tmp_path)
        assert json.loads(await _available(d, tmp_path, "--json")).get("dry_run", False) is False
    finally:
        await d.stop("test")


def test_the_real_gpu_is_recognised_however_the_backend_is_written() -> None:
    """`--backend NVML` opens the real GPUs as `nvml` does; it once left dry run off there and let
    simulated replays in, because those two readings compared the text exactly."""
    for spelled in ("NVML", " nvml ", "Nvml"):
        cfg = config.load(None, env={}, overrides={"server.backend": spelled})
        assert config.dry_run_of(cfg.server) is True, spelled
        assert config.accepts_replay(cfg) is False, spelled


async def test_a_daemon_on_nvml_written_in_capitals_starts_in_dry_run(tmp_path: Path) -> None:
    d, _sim = _nvml_daemon(tmp_path, **{"server.backend": "NVML"})
    await d.start()
    try:
        assert d.allocator.dry_run is True
    finally:
        await d.stop("test")
