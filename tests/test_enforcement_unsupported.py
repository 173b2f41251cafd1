"""A mechanism the driver does not have is a fact of the node, said once; one turned off after failing
at runtime is what VgpuEnforcementDisabled is for.

A real daemon (`Daemon`, what `vgpu serve` runs) on NVML over the fake pynvml, whose simulated GPU
lacks nvmlDeviceSetMemoryLimits_v1 (an older driver) or refuses the write (no privilege): the
daemon's own metrics registry, its log, and `vgpu doctor`'s check of the same driver."""

from __future__ import annotations

import asyncio
import io
import json
import os
from collections.abc import AsyncIterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry

from vgpu import config
from vgpu import ctl as cli
from vgpu.allocator.mechanisms.limits import CgroupMemoryLimits
from vgpu.daemon import doctor
from vgpu.daemon.serve import Daemon, SdNotifier
from vgpu.device.fake_pynvml import FakePynvml
from vgpu.device.nvml import NvmlBackend
from vgpu.device.sim import SimBackend


@dataclass
class Node:
    daemon: Daemon
    sim: SimBackend
    registry: CollectorRegistry
    logs: list[MutableMapping[str, Any]]
    device_id: str

    def gauge(self, name: str) -> float | None:
        return self.registry.get_sample_value(name, {"device": self.device_id, "mechanism": "cgroup_memory"})


@pytest.fixture
async def node(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Node]:
    """The driver has per-cgroup memory limits (param True) or not (False)."""
    cfg = config.load(None, env={}, overrides={
        "server.socket": str(tmp_path / "v.sock"), "server.state_dir": str(tmp_path / "state"),
        "server.backend": "nvml", "server.dry_run": False, "metrics.port": 0, "server.grace_s": 0.0,
    })
    sim = SimBackend(["h100-80gb"], memory_limits=request.param)
    registry = CollectorRegistry()
    d = Daemon(cfg, notifier=SdNotifier(env={}), registry=registry, backend=NvmlBackend(nvml=FakePynvml(sim)))
    with structlog.testing.capture_logs() as logs:
        await d.start()
    try:
        yield Node(d, sim, registry, logs, sim.devices()[0].uuid)
    finally:
        await d.stop("test")


async def _contend(node: Node, tmp_path: Path) -> None:
    """The operator's `vgpu request` for a process of this test (the operator token may name any
    pid) takes the GPU to 95 %: the daemon tries to cap the process's cgroup."""
    total = node.daemon.allocator.ledger.devices()[0].mem_total_mib
    out = io.StringIO()
    rc = await asyncio.to_thread(
        cli.request_main, ["--socket", str(node.daemon.socket_path), "--state-dir", str(node.daemon.state_dir),
                           "--json", "--app", "job", "--memory-mib", str(int(0.95 * total)), "--pid", str(os.getpid())],
        "vgpu request", out=out, env={"XDG_CONFIG_HOME": str(tmp_path / "cfg")})
    assert rc == 0, out.getvalue()
    assert json.loads(out.getvalue())["device_id"] == node.device_id


@pytest.mark.parametrize("node", [False], indirect=True)
async def test_a_driver_without_cgroup_limits_is_said_once_at_start_and_never_alerts(node: Node,
                                                                                     tmp_path: Path) -> None:
    said = [e for e in node.logs if e["event"] == "cgroup_memory_limit_unsupported"]
    assert [e["device"] for e in said] == [node.device_id] and said[0]["log_level"] == "warning"
    assert "NotSupported" in str(said[0]["reason"]) and "R615" in str(said[0]["fix"])
    assert not [e for e in node.logs if e["event"] == "cgroup_memory_limit_disabled"]
    # from the start, before any contention: unsupported, not disabled (the alert's series stays 0)
    assert (node.gauge("vgpu_enforcement_unsupported"), node.gauge("vgpu_enforcement_disabled")) == (1.0, 0.0)
    with structlog.testing.capture_logs() as later:
        await _contend(node, tmp_path)
    assert node.daemon.allocator.memory_enforcement(node.device_id).hard_mem  # contended: it would cap
    assert not [e for e in later if str(e["event"]).startswith("cgroup_memory_limit_")]  # said once, at start
    assert (node.gauge("vgpu_enforcement_unsupported"), node.gauge("vgpu_enforcement_disabled")) == (1.0, 0.0)
    assert node.registry.get_sample_value(
        "vgpu_enforcement_failures_total", {"device": node.device_id, "mechanism": "cgroup_memory"}) == 0


@pytest.mark.parametrize("node", [True], indirect=True)
async def test_a_write_refused_at_runtime_is_disabled_and_alerts(node: Node, tmp_path: Path) -> None:
    assert (node.gauge("vgpu_enforcement_unsupported"), node.gauge("vgpu_enforcement_disabled")) == (0.0, 0.0)
    assert not [e for e in node.logs if str(e["event"]).startswith("cgroup_memory_limit_")]
    node.sim.privileged = False  # the daemon lost the privilege to write device settings
    with structlog.testing.capture_logs() as later:
        await _contend(node, tmp_path)
    assert [e["event"] for e in later if str(e["event"]).startswith("cgroup_memory_limit_")] == [
        "cgroup_memory_limit_disabled"]
    assert (node.gauge("vgpu_enforcement_unsupported"), node.gauge("vgpu_enforcement_disabled")) == (0.0, 1.0)


def test_notsupported_after_a_write_worked_is_a_runtime_failure() -> None:
    """The same NotSupported once a cap of ours was written on the device (the driver changed under
    the daemon, or the GPU's mode did) is a failure, not the driver's nature."""
    sim = SimBackend(["h100-80gb"])
    dev = sim.devices()[0]
    lim = CgroupMemoryLimits(cgroup_exists=lambda _cg: True)
    assert lim.apply(dev, "/jobs/a", 1_000)
    sim.memory_limits = False
    assert not lim.apply(dev, "/jobs/a", 2_000)
    assert lim.disabled_reason(dev.uuid) is not None and not lim.unsupported(dev.uuid)
    lim2 = CgroupMemoryLimits()
    assert lim2.probe([dev]) == {dev.uuid: lim2.disabled_reason(dev.uuid)} and lim2.unsupported(dev.uuid)
    sim.memory_limits = True
    assert CgroupMemoryLimits().probe([dev]) == {}  # a driver that has them: nothing said


@pytest.mark.parametrize(("supported", "status"), [(True, "OK"), (False, "WARN")])
def test_doctor_names_the_gpus_without_cgroup_limits(supported: bool, status: str) -> None:
    sim = SimBackend(["h100-80gb", "h100-80gb"], memory_limits=supported)
    check = doctor.check_memory_limits(lambda: NvmlBackend(nvml=FakePynvml(sim)))
    assert check.status == status, check
    if not supported:
        assert all(d.uuid in check.detail for d in sim.devices()) and "cooperative" in check.detail
        assert "vgpu_enforcement_unsupported" in check.detail
    off = doctor.check_memory_limits(lambda: NvmlBackend(nvml=FakePynvml(sim)), enabled=False)
    assert off.status == "OK" and "server.cgroup_memory_limits = false" in off.detail
