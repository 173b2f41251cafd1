"""Per-application limits: the cooperative memory limit book, MPS control, NVML cgroup memory limits."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from allocator.errors import VerifyFailed
from allocator.limits import CgroupMemoryLimits, MemoryLimitBook, MpsControl, client_env, memory_fraction
from vgpu.device.errors import NotSupported
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


class LimitDevice:
    """A device whose backend wraps nvmlDevice{Set,Get}MemoryLimits_v1."""

    def __init__(self, *, supported: bool = True) -> None:
        self.uuid = "GPU-x"
        self.supported = supported
        self.limits: dict[str, tuple[float, float]] = {}

    def memory_limit_mib(self, cgroup: str) -> tuple[float, float]:
        if not self.supported:
            raise NotSupported("driver older than R615")
        return self.limits.get(cgroup, (float("inf"), float("inf")))

    def set_memory_limit_mib(self, cgroup: str, soft_mib: float, hard_mib: float) -> None:
        self.limits[cgroup] = (soft_mib, hard_mib)


def test_cgroup_limits_check_change_verify_and_restore() -> None:
    dev = LimitDevice()
    lim = CgroupMemoryLimits()
    assert lim.apply(dev, "/vgpu/app-a", 8_000)  # type: ignore[arg-type]
    assert dev.limits["/vgpu/app-a"] == (8_000, 8_000)
    assert not lim.apply(dev, "/vgpu/app-a", 8_000)  # type: ignore[arg-type]
    assert lim.writes == 1
    assert lim.restore() == [("GPU-x", "/vgpu/app-a", "restored")]
    assert dev.limits["/vgpu/app-a"] == (float("inf"), float("inf"))
    with pytest.raises(ValueError, match="absolute"):
        lim.apply(dev, "app", 1)  # type: ignore[arg-type]


def test_cgroup_limits_degrade_on_old_drivers_and_backends_without_support() -> None:
    lim = CgroupMemoryLimits()
    assert not lim.apply(LimitDevice(supported=False), "/vgpu/a", 1_000)  # type: ignore[arg-type]
    assert "NotSupported" in (lim.disabled_reason("GPU-x") or "")
    sim_dev = SimBackend(["h100-80gb"], clock=ManualClock()).devices()[0]
    assert not lim.apply(sim_dev, "/vgpu/a", 1_000)
    assert "no NVML memory-limit support" in (lim.disabled_reason(sim_dev.uuid) or "")
