"""Shared by G's daemon tests: an in-process `Daemon` on a simulated H100 in a temporary directory."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from manager.daemon import Daemon, SdNotifier
from vgpu import config


def sim_daemon(tmp_path: Path, **overrides: object) -> Daemon:
    """Not started: `await d.start()`, then `await d.stop("test")`."""
    cfg = config.load(None, env={}, overrides={
        "server.socket": str(tmp_path / "v.sock"), "server.state_dir": str(tmp_path / "state"),
        "server.backend": "sim:h100-80gb", "metrics.port": 0, "server.grace_s": 0.0, **overrides,
    })
    return Daemon(cfg, notifier=SdNotifier(env={}), registry=CollectorRegistry())
