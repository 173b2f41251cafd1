"""Per-application limits: the cooperative memory limit book, MPS control, NVML cgroup memory limits."""

from __future__ import annotations

import math
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from device_rigs import Rig, trace

from allocator.core import AllocationRequest, Allocator
from allocator.errors import VerifyFailed
from allocator.limits import (
    CgroupMemoryLimits,
    MemoryLimitBook,
    MpsControl,
    client_env,
    memory_fraction,
    read_cgroup,
)
from vgpu.device.base import MemoryLimitMib
from vgpu.device.sim import ManualClock, SimBackend


def test_memory_fraction() -> None:
    assert memory_fraction(20_000, 80_000) == pytest.approx(0.25)
    assert memory_fraction(100_000, 80_000) == 1.0
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            memory_fraction(bad, 80_000)
    with pytest.raises(ValueError):
        memory_fraction(1.0, 0.0)


def test_limit_book_tracks_what_clients_applied() -> None:
    book = MemoryLimitBook()
    book.publish("a", 10_000)
    assert book.status("a").state == "pending"
    book.report_applied("a", 10_000.4)
    assert book.status("a").state == "applied"
    book.report_applied("a", None)
    assert book.status("a").state == "not applied"
    book.report_applied("a", 5_000)
    assert book.status("a").state == "mismatch"
    book.publish("a", 12_000)  # a new limit resets the old report
    assert book.status("a").state == "pending"
    with pytest.raises(ValueError):
        book.publish("a", 0)
    book.forget("a")
    assert book.statuses() == []


class FakeMps:
    """An MPS control daemon behind the control-pipe command language."""

    def __init__(self, pct: float = 100.0, *, ignore_sets: bool = False) -> None:
        self.pct = pct
        self.ignore_sets = ignore_sets
        self.commands: list[str] = []

    def __call__(self, argv: list[str], stdin: str) -> str:
        cmd = stdin.strip()
        self.commands.append(cmd)
        if cmd == "get_default_active_thread_percentage":
            return f"{self.pct:.1f}\n"
        if cmd.startswith("set_default_active_thread_percentage "):
            if not self.ignore_sets:
                self.pct = float(cmd.split()[1])
            return ""
        raise subprocess.CalledProcessError(1, argv)


def mps(tmp_path: Path, fake: FakeMps, **kw: object) -> MpsControl:
    (tmp_path / "control").touch()
    return MpsControl(pipe_dir=tmp_path, runner=fake, which=lambda name: "/usr/bin/" + name, **kw)  # type: ignore[arg-type]


def test_mps_set_verifies_saves_the_original_and_restores(tmp_path: Path) -> None:
    fake = FakeMps(100.0)
    ctl = mps(tmp_path, fake)
    assert ctl.available()
    assert ctl.set_default_active_thread_pct(40)
    assert fake.pct == 40 and ctl.original_pct == 100
    assert not ctl.set_default_active_thread_pct(40)  # already there: no write
    assert ctl.writes == 1
    assert ctl.set_default_active_thread_pct(60)
    assert ctl.original_pct == 100  # saved once
    assert ctl.restore()
    assert fake.pct == 100


def test_mps_dry_run_writes_nothing(tmp_path: Path) -> None:
    fake = FakeMps(100.0)
    ctl = mps(tmp_path, fake, dry_run=True)
    assert not ctl.set_default_active_thread_pct(40)
    assert fake.pct == 100 and not any(c.startswith("set_") for c in fake.commands)


def test_mps_verify_failure_is_loud(tmp_path: Path) -> None:
    ctl = mps(tmp_path, FakeMps(100.0, ignore_sets=True))
    with pytest.raises(VerifyFailed):
        ctl.set_default_active_thread_pct(40)


def test_mps_absent_degrades_to_off_with_one_log_line(tmp_path: Path) -> None:
    lines: list[tuple[str, dict[str, object]]] = []

    class Log:
        def warning(self, event: str, **kw: object) -> None:
            lines.append((event, kw))

        def info(self, event: str, **kw: object) -> None:
            pass

    ctl = MpsControl(pipe_dir=tmp_path, which=lambda name: None, logger=Log())  # type: ignore[arg-type]
    assert not ctl.available()
    assert not ctl.set_default_active_thread_pct(50)
    assert not ctl.set_default_active_thread_pct(30)
    assert ctl.disabled is not None and len(lines) == 1
    assert MpsControl(environ={"CUDA_MPS_PIPE_DIRECTORY": "/x/y"}).pipe_dir == Path("/x/y")


def test_client_env() -> None:
    assert client_env(25) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    with pytest.raises(ValueError):
        client_env(0)


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, object]]] = []

    def _add(self, level: str, event: str, **kw: object) -> None:
        self.lines.append((level, event, kw))

    def info(self, event: str, **kw: object) -> None:
        self._add("info", event, **kw)

    def warning(self, event: str, **kw: object) -> None:
        self._add("warning", event, **kw)

    def error(self, event: str, **kw: object) -> None:
        self._add("error", event, **kw)


def test_cgroup_limits_check_change_verify_and_restore(rig: Rig) -> None:
    rig.need_writes()
    dev = rig.device()
    dev.set_memory_limit_mib("/jobs/b", 20_000, 30_000)  # an operator's limit, there before vgpu
    lim = CgroupMemoryLimits()
    assert lim.apply(dev, "/jobs/a", 8_000)
    assert dev.memory_limit_mib("/jobs/a")[:2] == (8_000, 8_000)
    assert not lim.apply(dev, "/jobs/a", 8_000) and lim.writes == 1  # already there: no write
    assert lim.apply(dev, "/jobs/a", 6_000.5)
    assert lim.apply(dev, "/jobs/b", 5_000)
    assert lim.limited(dev.uuid) == {"/jobs/a", "/jobs/b"}
    assert sorted(lim.restore()) == [(dev.uuid, "/jobs/a", "restored"), (dev.uuid, "/jobs/b", "restored")]
    assert dev.memory_limit_mib("/jobs/a")[:2] == (math.inf, math.inf)  # the first original, not 8000
    assert dev.memory_limit_mib("/jobs/b")[:2] == (20_000, 30_000)
    assert lim.restore() == [] and lim.limited(dev.uuid) == set()
    with pytest.raises(ValueError, match="absolute"):
        lim.apply(dev, "app", 1)
    with pytest.raises(ValueError, match="soft_mib"):
        lim.apply(dev, "/jobs/a", 1_000, soft_mib=2_000)


def test_cgroup_limits_degrade_once_where_the_driver_has_none(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory(memory_limits=False)
    dev = rig.device()
    log = _Log()
    lim = CgroupMemoryLimits(logger=log)  # type: ignore[arg-type]
    assert not lim.apply(dev, "/jobs/a", 1_000)
    assert not lim.apply(dev, "/jobs/b", 2_000)
    assert "NotSupported" in (lim.disabled_reason(dev.uuid) or "")
    assert [e for lvl, e, _ in log.lines if lvl == "warning"] == ["cgroup_memory_limit_disabled"]
    assert lim.writes == 0 and lim.restore() == []


def test_cgroup_limits_refused_write_turns_off_and_dry_run_writes_nothing(rig: Rig) -> None:
    sim = rig.need_sim()
    dev = rig.device()
    writes = rig.sim_device().writes
    dry = CgroupMemoryLimits(dry_run=True, logger=_Log())  # type: ignore[arg-type]
    assert not dry.apply(dev, "/jobs/a", 1_000)
    assert dev.memory_limit_mib("/jobs/a").hard_mib == math.inf and rig.sim_device().writes == writes
    assert dry.limited(dev.uuid) == set() and dry.restore() == []
    sim.privileged = False
    lim = CgroupMemoryLimits()
    assert not lim.apply(dev, "/jobs/a", 1_000)
    assert "NoPermission" in (lim.disabled_reason(dev.uuid) or "")
    assert dev.memory_limit_mib("/jobs/a").hard_mib == math.inf


def test_cgroup_limit_that_does_not_read_back_fails_loudly() -> None:
    sim_dev = SimBackend(["h100-80gb"], clock=ManualClock()).devices()[0]

    class Deaf:
        """Takes the write and ignores it."""

        uuid = sim_dev.uuid

        def memory_limit_mib(self, cgroup: str) -> MemoryLimitMib:
            return sim_dev.memory_limit_mib(cgroup)

        def set_memory_limit_mib(self, cgroup: str, soft_mib: float, hard_mib: float) -> None:
            pass

    with pytest.raises(VerifyFailed, match="/jobs/a"):
        CgroupMemoryLimits().apply(Deaf(), "/jobs/a", 1_000)  # type: ignore[arg-type]


def test_read_cgroup_v2_v1_and_gone(tmp_path: Path) -> None:
    (tmp_path / "10").mkdir()
    (tmp_path / "10" / "cgroup").write_text("0::/system.slice/train.scope\n")
    (tmp_path / "11").mkdir()
    (tmp_path / "11" / "cgroup").write_text("12:cpu,cpuacct:/a\n4:memory:/slurm/job_7\n1:name=systemd:/b\n")
    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "cgroup").write_text("garbage\n")
    assert read_cgroup(10, tmp_path) == "/system.slice/train.scope"
    assert read_cgroup(11, tmp_path) == "/slurm/job_7"
    assert read_cgroup(12, tmp_path) is None
    assert read_cgroup(13, tmp_path) is None  # the process is gone
    assert read_cgroup(0, tmp_path) is None
    mine = read_cgroup(os.getpid())
    assert mine is None or mine.startswith("/")


# --- the allocator: a grant's memory becomes its application's cgroup hard limit -----------------
def _allocator(rig: Rig, **kw: object) -> Allocator:
    cgroups = {4242: "/jobs/a", 4343: "/jobs/a", 5151: "/jobs/b"}
    return Allocator(rig.backend, clock=rig.clock, dry_run=kw.pop("dry_run", False),  # type: ignore[arg-type]
                     cgroup_limits=CgroupMemoryLimits(dry_run=bool(kw.pop("lim_dry_run", False)), logger=_Log()),  # type: ignore[arg-type]
                     cgroup_of=cgroups.get, **kw)  # type: ignore[arg-type]


def test_allocator_caps_the_application_cgroup_at_its_grant_and_restores(rig: Rig) -> None:
    rig.need_writes()
    dev = rig.device()
    alloc = _allocator(rig)
    g1 = alloc.request_allocation(AllocationRequest("a", memory_mib=8_000, pid=4242, device_id=dev.uuid))
    assert dev.memory_limit_mib("/jobs/a")[:2] == (8_000, 8_000)
    # a second application in the same cgroup: the cgroup gets both grants
    alloc.request_allocation(AllocationRequest("a2", memory_mib=2_000, pid=4343, device_id=dev.uuid))
    assert dev.memory_limit_mib("/jobs/a").hard_mib == 10_000
    alloc.request_allocation(AllocationRequest("nopid", memory_mib=1_000, device_id=dev.uuid))  # no pid: nothing
    alloc.request_allocation(AllocationRequest("b", memory_mib=3_000, pid=5151, device_id=dev.uuid))
    assert dev.memory_limit_mib("/jobs/b").hard_mib == 3_000
    alloc.release(g1.grant_id)
    assert dev.memory_limit_mib("/jobs/a").hard_mib == 2_000
    alloc.stop()
    assert dev.memory_limit_mib("/jobs/a").hard_mib == math.inf
    assert dev.memory_limit_mib("/jobs/b").hard_mib == math.inf
    assert alloc.counters.failures == {}


def test_allocator_cgroup_limit_clips_the_simulated_process(rig: Rig) -> None:
    sim = rig.need_sim()
    dev = rig.device()
    alloc = _allocator(rig)
    sim.launch("a", 4242, trace("a", [12_000] * 30, 20), cgroup="/jobs/a")
    rig.advance(0.5)
    assert [p.used_mib for p in dev.processes()] == [12_000]
    grant = alloc.request_allocation(AllocationRequest("a", memory_mib=9_000, pid=4242, device_id=dev.uuid))
    assert [p.used_mib for p in dev.processes()] == [9_000]  # capped at the grant
    alloc.release(grant.grant_id)  # the original (no limit) is back
    assert [p.used_mib for p in dev.processes()] == [12_000]


def test_allocator_dry_run_and_unsupported_driver_write_nothing(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory()
    rig.need_writes()
    dev = rig.device()
    writes = rig.sim_device().writes
    dry = _allocator(rig, dry_run=True, lim_dry_run=True)
    dry.request_allocation(AllocationRequest("a", memory_mib=8_000, pid=4242, device_id=dev.uuid))
    assert dev.memory_limit_mib("/jobs/a").hard_mib == math.inf and rig.sim_device().writes == writes
    assert dry.cgroup_limits is not None
    assert [e for _, e, _ in dry.cgroup_limits._log.lines] == ["cgroup_memory_limit_plan"]  # type: ignore[attr-defined]
    old = rig_factory(memory_limits=False)
    alloc = _allocator(old)
    grant = alloc.request_allocation(AllocationRequest("a", memory_mib=8_000, pid=4242, device_id=old.device().uuid))
    assert grant.memory_mib == 8_000  # the grant stands; the mechanism is off for the device
    assert alloc.cgroup_limits is not None and alloc.cgroup_limits.disabled_reason(old.device().uuid)
    assert alloc.counters.failures == {}
