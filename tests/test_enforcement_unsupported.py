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
import subprocess
import sys
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
from vgpu.allocator.mechanisms.power import PowerLimitMechanism
from vgpu.daemon import doctor
from vgpu.daemon.serve import Daemon, SdNotifier
from vgpu.device.errors import GpuLost, NotSupported
from vgpu.device.fake_pynvml import FakePynvml
from vgpu.device.nvml import NvmlBackend
from vgpu.device.sim import SimBackend, SimDevice


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


def test_notsupported_after_a_cap_was_restored_is_still_a_runtime_failure() -> None:
    """The cgroup limits worked on the device once, and their original was written back: a
    NotSupported after that is a failure at runtime (disabled, what the alert is for), not a driver
    without the limits (unsupported)."""
    sim = SimBackend(["h100-80gb"])
    dev = sim.devices()[0]
    lim = CgroupMemoryLimits(cgroup_exists=lambda _cg: True)
    assert lim.apply(dev, "/jobs/a", 1_000)
    assert lim.restore_one(dev.uuid, "/jobs/a") == "restored" and lim.limited(dev.uuid) == set()
    sim.memory_limits = False
    assert not lim.apply(dev, "/jobs/b", 2_000)
    assert "NotSupported" in (lim.disabled_reason(dev.uuid) or "") and not lim.unsupported(dev.uuid)
    probed = CgroupMemoryLimits(cgroup_exists=lambda _cg: True)
    sim.memory_limits = True
    assert probed.apply(dev, "/jobs/a", 1_000) and probed.restore() == [(dev.uuid, "/jobs/a", "restored")]
    sim.memory_limits = False
    assert probed.probe([dev]) == {} and not probed.unsupported(dev.uuid)  # the start-up question too
    assert probed.disabled_reason(dev.uuid) is not None


@pytest.mark.parametrize("refusing", ["power_constraints", "set_power_limit_mw"])
def test_power_notsupported_after_a_restore_is_still_a_runtime_failure(refusing: str) -> None:
    """As for cgroup limits: the power limit was written (and read back) on the device, then its
    original put back; a NotSupported after that, on the read or on the write, is disabled."""
    sim = SimBackend(["h100-80gb"])
    dev = sim.devices()[0]
    power = PowerLimitMechanism()
    assert power.apply(dev, 400_000).changed
    assert [r.changed for r in power.restore()] == [True] and power.original_mw(dev.uuid) is None
    dev.inject(refusing, NotSupported, times=None)
    result = power.apply(dev, 300_000)
    assert not result.changed and power.disabled_reason(dev.uuid) is not None, result
    assert not power.unsupported(dev.uuid)
    fresh = SimBackend(["h100-80gb"]).devices()[0]  # the same answer where nothing ever worked: unsupported
    fresh.inject(refusing, NotSupported, times=None)
    other = PowerLimitMechanism()
    assert not other.apply(fresh, 300_000).changed and other.unsupported(fresh.uuid)


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


# `vgpu doctor` run as its user runs it, a process of its own, with NVML the fake pynvml over a simulated
# GPU: the child puts the fake where `import pynvml` finds it, then runs the CLI's entry point.
_DOCTOR_ON_FAKE_NVML = """
import sys
import pynvml
from vgpu.device.fake_pynvml import FakePynvml
from vgpu.device.sim import SimBackend
from vgpu.cli import main
fake = FakePynvml(SimBackend(["h100-80gb", "h100-80gb"]))
fault = sys.argv[1]
if fault != "none":
    function, code = fault.split("=")
    fake.inject(function, getattr(pynvml, code), times=None)
sys.modules["pynvml"] = fake
sys.exit(main(["doctor", "--json", *sys.argv[2:]]))
"""


def _doctor_on_fake_nvml(tmp_path: Path, fault: str) -> dict[str, list[dict[str, str]]]:
    args = ["--backend", "nvml", "--socket", str(tmp_path / "none.sock"), "--state-dir", str(tmp_path / "state"),
            "--model", str(tmp_path / "no-model.pt")]  # a model that is not there: nothing is loaded
    env = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", _DOCTOR_ON_FAKE_NVML, fault, *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert "Traceback" not in done.stderr, done.stderr
    checks: dict[str, list[dict[str, str]]] = {}
    for c in json.loads(done.stdout):
        checks.setdefault(c["name"], []).append(c)
    return checks


def test_doctor_without_privilege_says_it_could_not_check_memory_limits_rather_than_ok(tmp_path: Path) -> None:
    """NVML refuses the read of the limits to a caller without privilege: that says nothing about
    whether the driver has them, so the line is a warning naming the GPUs and the fix, not OK."""
    fine = _doctor_on_fake_nvml(tmp_path, "none")
    assert fine["memlimits"][0]["status"] == "OK", fine["memlimits"]
    refused = _doctor_on_fake_nvml(tmp_path, "nvmlDeviceGetMemoryLimits_v1=NVML_ERROR_NO_PERMISSION")
    [line] = refused["memlimits"]
    assert line["status"] == "WARN" and line["detail"].startswith("could not check GPU 0 (GPU-"), line
    assert ", 1 (GPU-" in line["detail"] and "no permission" in line["detail"] and "root" in line["detail"]
    assert "NoPermission" in line["detail"] and "cooperative" not in line["detail"]
    assert refused["nvml"][0]["status"] == "OK"  # NVML itself opens: only the limits were refused


def test_doctor_says_an_nvml_error_while_listing_the_devices_in_a_line(tmp_path: Path) -> None:
    checks = _doctor_on_fake_nvml(tmp_path, "nvmlDeviceGetUUID=NVML_ERROR_NO_PERMISSION")
    [nvml] = checks["nvml"]
    assert nvml["status"] == "FAIL" and "device listing" in nvml["detail"], nvml
    assert "nvmlDeviceGetUUID" in nvml["detail"] and "NoPermission" in nvml["detail"]
    assert checks["memlimits"][0]["status"] == "WARN" and "not checked" in checks["memlimits"][0]["detail"]


class _ListingFails(SimBackend):
    """A backend that opens but whose device listing raises (a GPU lost between open and list)."""

    def devices(self) -> list[SimDevice]:
        raise GpuLost("nvmlDeviceGetHandleByIndex: GPU is lost (NVML code 15)")


def test_doctor_lines_for_a_device_listing_that_raises() -> None:
    nvml = doctor.check_nvml(lambda: _ListingFails(["h100-80gb"]))
    assert nvml.status == "FAIL" and "listing the devices failed: GpuLost" in nvml.detail, nvml
    mem = doctor.check_memory_limits(lambda: _ListingFails(["h100-80gb"]))
    assert mem.status == "WARN" and "not checked: listing the devices failed (GpuLost)" in mem.detail, mem
