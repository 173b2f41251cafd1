"""Per-application limits: the cooperative memory limit book, MPS control, NVML cgroup memory limits
(their originals recorded in the store and restored after a crash)."""

from __future__ import annotations

import math
import os
import sqlite3
import subprocess
from collections.abc import Callable, Collection
from pathlib import Path

import pytest
from daemon_fixtures import FullDisk
from device_rigs import Rig, trace

from vgpu.allocator.core import AllocationRequest, Allocator
from vgpu.allocator.errors import VerifyFailed
from vgpu.allocator.ledger import Ledger
from vgpu.allocator.mechanisms.limits import (
    CgroupMemoryLimits,
    MemoryLimitBook,
    MpsControl,
    cgroup_exists,
    client_env,
    memory_fraction,
    read_cgroup,
)
from vgpu.allocator.store import CgroupOriginal, Store
from vgpu.daemon.serve import reconcile
from vgpu.device.base import Device, MemoryLimitMib
from vgpu.device.errors import NotFound
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
    assert "NotSupported" in (lim.disabled_reason(dev.uuid) or "") and lim.unsupported(dev.uuid)
    # the driver's nature, not a failure: said once as such
    assert [e for lvl, e, _ in log.lines if lvl == "warning"] == ["cgroup_memory_limit_unsupported"]
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
    assert "NoPermission" in (lim.disabled_reason(dev.uuid) or "") and not lim.unsupported(dev.uuid)
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
    (tmp_path / "14").mkdir()
    (tmp_path / "14" / "cgroup").write_bytes(b"0::/user.slice/\xff\n")  # a user's cgroup named in bytes
    assert read_cgroup(14, tmp_path) is None  # that are not UTF-8: nothing usable, not UnicodeDecodeError
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


def test_a_grant_equal_to_the_cgroup_s_existing_limit_is_hard_without_a_write(rig: Rig) -> None:
    """The cgroup already holds exactly the cap the grant asks for (an operator's limit): the limit
    in force is the grant's, so the application is told "hard", nothing is written, and its release
    leaves the operator's limit as it found it."""
    rig.need_writes()
    dev = rig.device()
    dev.set_memory_limit_mib("/jobs/a", 8_000, 8_000)  # an operator's limit, there before vgpu
    alloc = _allocator(rig)
    lim = alloc.cgroup_limits
    assert lim is not None
    g1 = alloc.request_allocation(AllocationRequest("a", memory_mib=8_000, pid=4242, device_id=dev.uuid))
    assert lim.writes == 0 and dev.memory_limit_mib("/jobs/a")[:2] == (8_000, 8_000)
    kind, why = alloc.app_memory_limit("a")
    assert (kind, "writing it failed" in why) == ("hard", False), why
    assert lim.capped(dev.uuid) == {"/jobs/a"}
    # a second application in the cgroup: a cap of ours over the operator's, which is what comes back
    g2 = alloc.request_allocation(AllocationRequest("a2", memory_mib=2_000, pid=4343, device_id=dev.uuid))
    assert lim.writes == 1 and dev.memory_limit_mib("/jobs/a").hard_mib == 10_000
    alloc.release(g2.grant_id)
    assert dev.memory_limit_mib("/jobs/a")[:2] == (8_000, 8_000) and alloc.app_memory_limit("a")[0] == "hard"
    writes = lim.writes
    alloc.release(g1.grant_id)
    assert dev.memory_limit_mib("/jobs/a")[:2] == (8_000, 8_000) and lim.writes == writes  # as it was: no write
    assert lim.capped(dev.uuid) == set() and lim.limited(dev.uuid) == set()
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


# --- originals in the store: a daemon restarted after a crash puts back the true original ---------------
class _Spy:
    """A device that notes, at each limit write, what the store holds for that cgroup."""

    def __init__(self, dev: Device, store: Store) -> None:
        self.dev, self.store, self.uuid = dev, store, dev.uuid
        self.seen: list[CgroupOriginal | None] = []

    def memory_limit_mib(self, cgroup: str) -> MemoryLimitMib:
        return self.dev.memory_limit_mib(cgroup)

    def set_memory_limit_mib(self, cgroup: str, soft_mib: float, hard_mib: float) -> None:
        self.seen.append(self.store.cgroup_original(self.uuid, cgroup))
        self.dev.set_memory_limit_mib(cgroup, soft_mib, hard_mib)


def test_cgroup_original_is_recorded_before_the_first_write(rig: Rig, tmp_path: Path) -> None:
    rig.need_writes()
    dev = rig.device()
    dev.set_memory_limit_mib("/jobs/a", 20_000, 30_000)  # an operator's limit, there before vgpu
    with Store(tmp_path) as store:
        spy = _Spy(dev, store)
        lim = CgroupMemoryLimits(store=store, clock=lambda: 5.0, logger=_Log())  # type: ignore[arg-type]
        first = CgroupOriginal(dev.uuid, "/jobs/a", 20_000, 30_000, 5.0)
        assert lim.apply(spy, "/jobs/a", 8_000)  # type: ignore[arg-type]
        assert spy.seen == [first]  # on record when the write happened
        assert lim.apply(spy, "/jobs/a", 6_000)  # type: ignore[arg-type]
        assert not lim.apply(spy, "/jobs/a", 6_000)  # type: ignore[arg-type]
        assert spy.seen == [first, first] and store.cgroup_originals() == [first]
        dry = CgroupMemoryLimits(dry_run=True, store=store, logger=_Log())  # type: ignore[arg-type]
        assert not dry.apply(spy, "/jobs/b", 1_000)  # type: ignore[arg-type]
        assert store.cgroup_originals() == [first] and len(spy.seen) == 2  # records nothing, writes nothing


class _FullStore:
    """A store on a full disk: recording a cgroup original fails as SQLite does."""

    def save_cgroup_original(self, original: object) -> bool:
        raise sqlite3.OperationalError("database or disk is full")


def test_a_cap_that_cannot_be_recorded_never_fails_the_stored_grant(rig: Rig) -> None:
    rig.need_writes()
    dev = rig.device()
    alloc = Allocator(rig.backend, clock=rig.clock, dry_run=False,  # type: ignore[arg-type]
                      cgroup_limits=CgroupMemoryLimits(store=_FullStore(), logger=_Log()),  # type: ignore[arg-type]
                      cgroup_of={4242: "/jobs/a"}.get)
    grant = alloc.request_allocation(AllocationRequest("a", memory_mib=8_000, pid=4242, device_id=dev.uuid))
    assert alloc.ledger.get(grant.grant_id) == grant  # the grant stands
    assert dev.memory_limit_mib("/jobs/a").hard_mib == math.inf  # nothing written without its original on record
    assert alloc.counters.failures == {(dev.uuid, "cgroup_memory"): 1}



def test_originals_that_cannot_be_forgotten_leave_every_cgroup_restored(rig: Rig, tmp_path: Path) -> None:
    """At a stop on a full state directory every cgroup gets its original back (one warning each for
    the records left stored); a later cap there records its own original, and the next start writes
    back the stored one, the same values, and forgets it."""
    rig.need_writes()
    dev = rig.device()
    dev.set_memory_limit_mib("/jobs/b", 20_000, 30_000)  # an operator's limit, there before vgpu
    with Store(tmp_path) as store:
        log = _Log()
        lim = CgroupMemoryLimits(store=store, logger=log)  # type: ignore[arg-type]
        assert lim.apply(dev, "/jobs/a", 8_000) and lim.apply(dev, "/jobs/b", 5_000)
        db = store._db
        store._db = FullDisk(db)  # type: ignore[assignment]
        assert sorted(lim.restore()) == [(dev.uuid, "/jobs/a", "restored"), (dev.uuid, "/jobs/b", "restored")]
        assert dev.memory_limit_mib("/jobs/a")[:2] == (math.inf, math.inf)
        assert dev.memory_limit_mib("/jobs/b")[:2] == (20_000, 30_000)
        assert [(lvl, ev, kw["cgroup"]) for lvl, ev, kw in log.lines if ev.endswith("not_forgotten")] == [
            ("warning", "cgroup_memory_limit_original_not_forgotten", "/jobs/a"),
            ("warning", "cgroup_memory_limit_original_not_forgotten", "/jobs/b")]
        assert len(store.cgroup_originals()) == 2
        # the disk frees; the operator changes /jobs/b's limit, and vgpu caps it again: its original now
        store._db = db
        dev.set_memory_limit_mib("/jobs/b", 25_000, 40_000)
        assert lim.apply(dev, "/jobs/b", 5_000)
        stored = store.cgroup_original(dev.uuid, "/jobs/b")
        assert stored is not None and (stored.soft_mib, stored.hard_mib) == (25_000, 40_000)
        assert lim.restore() == [(dev.uuid, "/jobs/b", "restored")]
        assert dev.memory_limit_mib("/jobs/b")[:2] == (25_000, 40_000)
        # the next start: the record left for /jobs/a is written back (what it holds) and forgotten
        again = CgroupMemoryLimits(store=store, logger=_Log())  # type: ignore[arg-type]
        assert again.reconcile(rig.backend, {}) == [(dev.uuid, "/jobs/a", "restored")]
        assert dev.memory_limit_mib("/jobs/a")[:2] == (math.inf, math.inf) and store.cgroup_originals() == []

def _persisting(rig: Rig, store: Store, *, dry_run: bool = False, log: _Log | None = None,
                cgroup_exists: Callable[[str], bool] = lambda cg: True, ledger: Ledger | None = None) -> Allocator:
    """An allocator whose cgroup originals go to `store` and whose ledger is saved there on each change."""
    lim = CgroupMemoryLimits(dry_run=dry_run, store=store, cgroup_exists=cgroup_exists, logger=log or _Log())  # type: ignore[arg-type]

    def save(led: Ledger) -> None:
        store.save_ledger(led.to_records())

    return Allocator(rig.backend, clock=rig.clock, dry_run=dry_run, ledger=ledger, cgroup_limits=lim,  # type: ignore[arg-type]
                     cgroup_of={4242: "/jobs/a", 5151: "/jobs/b"}.get, on_change=save)


def _crash(rig: Rig, tmp_path: Path) -> None:
    """A daemon capped /jobs/a (operator's limit 20000/30000 before it) and /jobs/b (none), then died:
    no stop, so its own limits stay on the device and the originals only in its store."""
    dev = rig.device()
    dev.set_memory_limit_mib("/jobs/a", 20_000, 30_000)
    store = Store(tmp_path)
    alloc = _persisting(rig, store)
    alloc.request_allocation(AllocationRequest("a", memory_mib=8_000, pid=4242, device_id=dev.uuid))
    alloc.request_allocation(AllocationRequest("b", memory_mib=3_000, pid=5151, device_id=dev.uuid))
    assert dev.memory_limit_mib("/jobs/a")[:2] == (8_000, 8_000) and dev.memory_limit_mib("/jobs/b").hard_mib == 3_000
    store.close()  # what the kernel does for a killed process; the rows were committed before each write


def _restart(rig: Rig, store: Store, *, alive: Collection[int] = (5151,)) -> Ledger:
    """The daemon's start-up reconcile of the ledger: grants of processes that are gone are released."""
    ledger, _ = reconcile(store, rig.backend, clock=lambda: 2_000.0, pid_exists=lambda pid: pid in alive)
    return ledger


def test_a_restart_after_a_crash_restores_the_true_original(rig: Rig, tmp_path: Path) -> None:
    rig.need_writes()
    dev = rig.device()
    _crash(rig, tmp_path)
    with Store(tmp_path) as store:
        alloc = _persisting(rig, store, ledger=_restart(rig, store))  # app a exited meanwhile, b runs on
        assert sorted(alloc.reconcile_cgroup_limits()) == [(dev.uuid, "/jobs/a", "restored"),
                                                           (dev.uuid, "/jobs/b", "kept: in use")]
        assert dev.memory_limit_mib("/jobs/a")[:2] == (20_000, 30_000)  # the operator's, not vgpu's 8000
        assert dev.memory_limit_mib("/jobs/b").hard_mib == 3_000  # still b's cap
        assert alloc.app_memory_limit("b")[0] == "hard"  # in force on its process, before any new write
        assert [(o.cgroup, o.hard_mib) for o in store.cgroup_originals()] == [("/jobs/b", math.inf)]
        (grant,) = alloc.ledger.grants()
        alloc.release(grant.grant_id)  # the eventual restore writes the true original, not 3000
        assert dev.memory_limit_mib("/jobs/b").hard_mib == math.inf
        assert store.cgroup_originals() == [] and alloc.counters.failures == {}


def test_a_restart_keeps_the_first_record_without_reconciling(rig: Rig, tmp_path: Path) -> None:
    rig.need_writes()
    dev = rig.device()
    _crash(rig, tmp_path)
    with Store(tmp_path) as store:
        alloc = _persisting(rig, store, ledger=_restart(rig, store, alive=(4242, 5151)))
        # no reconcile: the next write to /jobs/b reads vgpu's 3000 as "before", the store says inf
        alloc.request_allocation(AllocationRequest("b2", memory_mib=1_000, pid=5151, device_id=dev.uuid))
        assert dev.memory_limit_mib("/jobs/b").hard_mib == 4_000
        assert store.cgroup_original(dev.uuid, "/jobs/b") is not None
        assert store.cgroup_original(dev.uuid, "/jobs/b").hard_mib == math.inf  # type: ignore[union-attr]
        # /jobs/a still holds the crashed run's 8000, exactly a's grant: that cap is in force, adopted
        # with the first record as its original
        assert alloc.app_memory_limit("a")[0] == "hard"
        alloc.stop()
        assert dev.memory_limit_mib("/jobs/b").hard_mib == math.inf
        assert dev.memory_limit_mib("/jobs/a")[:2] == (20_000, 30_000)  # the true original, from the record
        assert store.cgroup_originals() == []


def test_restoring_forgets_the_record(rig: Rig, tmp_path: Path) -> None:
    rig.need_writes()
    dev = rig.device()
    with Store(tmp_path) as store:
        alloc = _persisting(rig, store)
        g = alloc.request_allocation(AllocationRequest("a", memory_mib=8_000, pid=4242, device_id=dev.uuid))
        assert [o.cgroup for o in store.cgroup_originals()] == ["/jobs/a"]
        alloc.release(g.grant_id)
        assert store.cgroup_originals() == []
        alloc.request_allocation(AllocationRequest("b", memory_mib=1_000, pid=5151, device_id=dev.uuid))
        assert [o.cgroup for o in store.cgroup_originals()] == ["/jobs/b"]
        alloc.stop()
        assert store.cgroup_originals() == [] and dev.memory_limit_mib("/jobs/b").hard_mib == math.inf


def _no_permission(rig: Rig, store: Store) -> None:
    rig.need_sim().privileged = False


def _not_supported(rig: Rig, store: Store) -> None:
    rig.need_sim().memory_limits = False  # a driver without the functions now


def _gpu_lost(rig: Rig, store: Store) -> None:
    rig.sim_device().lose()


def _namespace_not_found(rig: Rig, store: Store) -> None:
    rig.sim_device().inject("memory_limit_mib", NotFound, times=None)


def _device_gone(rig: Rig, store: Store) -> None:
    """The record is of a device this node no longer has."""
    store.forget_cgroup_original(rig.device().uuid, "/jobs/a")
    store.save_cgroup_original(CgroupOriginal("GPU-gone", "/jobs/a", math.inf, math.inf, 1.0))


# (break the node, does the cgroup still exist, expected outcome for /jobs/a, its record kept)
FAILURES = {
    "no permission": (_no_permission, True, "failed: NoPermission", True),
    "not supported": (_not_supported, True, "failed: NotSupported", True),
    "gpu lost": (_gpu_lost, True, "failed: GpuLost", True),
    "device gone": (_device_gone, True, "failed: NotFound", True),
    "cgroup gone": (_no_permission, False, "forgotten: cgroup gone", False),
    "namespace not found": (_namespace_not_found, True, "forgotten: cgroup gone", False),
    "device and cgroup gone": (_device_gone, False, "forgotten: cgroup gone", False),
}


@pytest.mark.parametrize("name", list(FAILURES))
def test_reconcile_failures_are_one_line_each_and_keep_what_can_still_be_restored(
    rig: Rig, tmp_path: Path, name: str
) -> None:
    rig.need_sim()
    breaks, exists, outcome, kept = FAILURES[name]
    _crash(rig, tmp_path)
    log = _Log()
    with Store(tmp_path) as store:
        alloc = _persisting(rig, store, log=log, cgroup_exists=lambda cg: exists, ledger=_restart(rig, store))
        breaks(rig, store)
        outcomes = {cg: (dev, out) for dev, cg, out in alloc.reconcile_cgroup_limits()}
        dev_a, out_a = outcomes["/jobs/a"]
        assert out_a.startswith(outcome), outcomes
        assert outcomes["/jobs/b"][1] == "kept: in use"  # b's process lives: no device call needed
        about_a = [(level, event) for level, event, kw in log.lines if kw.get("cgroup") == "/jobs/a"]
        assert about_a == [("error", "cgroup_memory_limit_restore_failed") if kept
                           else ("warning", "cgroup_memory_limit_original_forgotten")]
        assert any(o.cgroup == "/jobs/a" for o in store.cgroup_originals()) is kept
        assert alloc.counters.failures == ({(dev_a, "cgroup_memory"): 1} if kept else {})
        if name in ("no permission", "not supported"):  # off for the device, as when a write is refused
            assert alloc.cgroup_limits is not None and alloc.cgroup_limits.disabled_reason(dev_a)
            assert not [e for _, e, _ in log.lines if e == "cgroup_memory_limit_disabled"]  # said once, above


def test_a_restore_that_failed_is_done_at_the_next_start(rig: Rig, tmp_path: Path) -> None:
    sim = rig.need_sim()
    dev = rig.device()
    _crash(rig, tmp_path)
    with Store(tmp_path) as store:
        sim.privileged = False
        first = _persisting(rig, store, ledger=_restart(rig, store))
        assert dict(((d, c), o) for d, c, o in first.reconcile_cgroup_limits())[(dev.uuid, "/jobs/a")].startswith("failed")
        sim.privileged = True  # fixed; the daemon crashes again, or stops: either way a next start
        again = _persisting(rig, store, ledger=_restart(rig, store))
        assert (dev.uuid, "/jobs/a", "restored") in again.reconcile_cgroup_limits()
        assert dev.memory_limit_mib("/jobs/a")[:2] == (20_000, 30_000)


def test_dry_run_reconcile_touches_neither_the_device_nor_the_store(rig: Rig, tmp_path: Path) -> None:
    rig.need_sim()
    dev = rig.device()
    _crash(rig, tmp_path)
    with Store(tmp_path) as store:
        ledger = _restart(rig, store)
        before, writes, log = store.cgroup_originals(), rig.sim_device().writes, _Log()
        store.writes = 0
        alloc = _persisting(rig, store, dry_run=True, log=log, cgroup_exists=lambda cg: False, ledger=ledger)
        assert sorted(alloc.reconcile_cgroup_limits()) == [(dev.uuid, "/jobs/a", "planned"),
                                                           (dev.uuid, "/jobs/b", "kept: in use")]
        alloc.request_allocation(AllocationRequest("b2", memory_mib=500, pid=5151, device_id=dev.uuid))
        alloc.stop()
        assert store.cgroup_originals() == before and rig.sim_device().writes == writes
        assert store.writes == 1  # the ledger save of b2's grant; no cgroup original written or forgotten
        assert dev.memory_limit_mib("/jobs/a").hard_mib == 8_000
        assert [e for _, e, kw in log.lines if kw.get("cgroup") == "/jobs/a"] == ["cgroup_memory_limit_plan"]


def test_cgroup_exists_under_v2_v1_or_unknown(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "system.slice" / "train.scope").mkdir(parents=True)
    (v2 / "cgroup.controllers").touch()
    assert cgroup_exists("/system.slice/train.scope", v2) and cgroup_exists("/", v2)
    assert not cgroup_exists("/system.slice/gone.scope", v2)
    v1 = tmp_path / "v1"
    (v1 / "memory" / "slurm" / "job_7").mkdir(parents=True)
    (v1 / "memory" / "cgroup.procs").touch()
    assert cgroup_exists("/slurm/job_7", v1) and not cgroup_exists("/slurm/job_8", v1)
    assert cgroup_exists("/anything", tmp_path / "not-mounted")  # unknown: kept, not dropped


async def test_the_daemon_restores_a_crashed_run_s_cgroup_limits_at_start(tmp_path: Path) -> None:
    """Through `Daemon.start`, with the mechanism on and off (off: nothing would restore it later)."""
    from daemon_fixtures import sim_daemon
    from prometheus_client import CollectorRegistry

    from vgpu.daemon.serve import Daemon, SdNotifier

    for on in (True, False):
        sim = SimBackend(["h100-80gb"], clock=ManualClock(1000.0))
        dev = sim.devices()[0]
        dev.set_memory_limit_mib("/jobs/gone", 8_000, 8_000)  # what the crashed daemon left
        state = tmp_path / str(on)
        with Store(state / "state") as store:
            store.save_cgroup_original(CgroupOriginal(dev.uuid, "/jobs/gone", 20_000, 30_000, 1.0))
        cfg = sim_daemon(state, **{"server.cgroup_memory_limits": on}).cfg  # type: ignore[arg-type]
        d = Daemon(cfg, backend=sim, notifier=SdNotifier(env={}), registry=CollectorRegistry(),
                   load_sizer=lambda: None)  # type: ignore[arg-type, return-value]
        await d.start()
        try:
            assert dev.memory_limit_mib("/jobs/gone")[:2] == (20_000, 30_000)
            assert d.store.cgroup_originals() == []
        finally:
            await d.stop("test")
