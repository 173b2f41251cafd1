"""vgpu/daemon/serve.py reconcile() and restore_devices(), and the persistent simulated GPU, without processes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import structlog
from daemon_fixtures import FullDisk
from structlog.testing import capture_logs

from vgpu.allocator.ledger import Ledger
from vgpu.allocator.store import Store
from vgpu.daemon.serve import read_original, reconcile, restore_devices
from vgpu.device.errors import GpuLost
from vgpu.device.simstate import PersistentSimBackend, read_state

LOG = structlog.get_logger("test")


def _mig_backend(path: Path) -> PersistentSimBackend:
    path.write_text(json.dumps({"version": 1, "devices": {}}))
    b = PersistentSimBackend(["h100-80gb"], path, mig_reconfig_s=0.0)
    b.devices()[0].set_mig_mode(True)
    return b


def test_sim_state_outlives_the_backend(tmp_path: Path) -> None:
    path = tmp_path / "sim.json"
    b = _mig_backend(path)
    dev = b.devices()[0]
    dev.create_gpu_instance(9, 0)
    dev.set_power_limit_mw(500_000)
    again = PersistentSimBackend(["h100-80gb"], path, mig_reconfig_s=0.0).devices()[0]
    assert again.power_limit_mw() == 500_000 and again.mig_enabled()
    assert [(g.profile_name, g.placement.start) for g in again.gpu_instances()] == [("3g.40gb", 0)]
    assert read_state(path)[dev.uuid]["power_limit_mw"] == 500_000


def test_sim_cgroup_memory_limits_outlive_the_backend(tmp_path: Path) -> None:
    path = tmp_path / "sim.json"
    dev = PersistentSimBackend(["h100-80gb"], path).devices()[0]
    dev.set_memory_limit_mib("/job/a", 6000.0, 8000.0)
    dev.set_memory_limit_mib("/job/b", 1000.0, 2000.0)
    dev.set_memory_limit_mib("/job/b", math.inf, math.inf)  # lifted again: not kept
    assert read_state(path)[dev.uuid]["memory_limits_mib"] == {"/job/a": [6000.0, 8000.0]}
    again = PersistentSimBackend(["h100-80gb"], path).devices()[0]
    assert (again.memory_limit_mib("/job/a").soft_mib, again.memory_limit_mib("/job/a").hard_mib) == (6000.0, 8000.0)
    assert again.memory_limit_mib("/job/b").hard_mib == math.inf
    # a driver without the functions: the saved limits cannot be put back, and the backend still starts
    no_limits = PersistentSimBackend(["h100-80gb"], path, memory_limits=False).devices()[0]
    assert no_limits.power_limit_mw() == again.power_limit_mw()


def test_restore_puts_power_and_mig_back_then_forgets(tmp_path: Path) -> None:
    b = _mig_backend(tmp_path / "sim.json")
    dev = b.devices()[0]
    dev.create_gpu_instance(9, 0)
    dev.create_gpu_instance(9, 4)
    with Store(tmp_path) as store:
        ledger, rec = reconcile(store, b, clock=lambda: 1.0)
        assert isinstance(ledger, Ledger) and rec.devices_not_original == {}
        # What an allocator would do while running: another layout, a lower limit.
        for gi in dev.gpu_instances():
            dev.destroy_gpu_instance(gi.instance_id)
        dev.create_gpu_instance(0, 0)
        dev.set_power_limit_mw(300_000)
        _, rec = reconcile(store, b, clock=lambda: 2.0)  # a restart sees it and says so
        assert "power limit 300000 mW" in rec.devices_not_original[dev.uuid]
        assert "MIG [7g.80gb@0], original [3g.40gb@0, 3g.40gb@4]" in rec.devices_not_original[dev.uuid]
        actions = restore_devices(store, b, LOG)
        assert {a["mechanism"] for a in actions} == {"power_limit", "mig"}
        now = read_original(dev, 0.0)
        assert now.power_limit_mw == 700_000
        assert [(s.profile_id, s.start) for s in now.mig_layout] == [(9, 0), (9, 4)]
        assert store.originals() == {}
        assert restore_devices(store, b, LOG) == []  # nothing left to do


def test_failed_restore_keeps_the_original_for_next_time(tmp_path: Path) -> None:
    b = PersistentSimBackend(["h100-80gb"], tmp_path / "sim.json")
    dev = b.devices()[0]
    with Store(tmp_path) as store:
        reconcile(store, b, clock=lambda: 1.0)
        dev.set_power_limit_mw(400_000)
        dev.inner.inject("set_power_limit_mw", GpuLost, times=1)
        with capture_logs() as logs:
            assert restore_devices(store, b, LOG) == []
        assert logs[0]["event"] == "device_restore_failed" and "power_limit" == logs[0]["mechanism"]
        assert store.original(dev.uuid) is not None and store.original(dev.uuid).power_limit_mw == 700_000
        restore_devices(store, b, LOG)
        assert dev.power_limit_mw() == 700_000 and store.originals() == {}


def test_originals_that_cannot_be_forgotten_leave_every_device_restored(tmp_path: Path) -> None:
    """Forgetting a restored original is best effort: on a full state directory every device is still
    put back, one warning says which originals stay stored, and the next start finds those devices
    at their originals, with nothing to report; its stop forgets them."""
    b = PersistentSimBackend(["h100-80gb", "h100-80gb"], tmp_path / "sim.json")
    devs = b.devices()
    with Store(tmp_path) as store:
        reconcile(store, b, clock=lambda: 1.0)
        for dev, mw in zip(devs, (400_000, 450_000), strict=True):
            dev.set_power_limit_mw(mw)
        db = store._db
        store._db = FullDisk(db)  # type: ignore[assignment]
        with capture_logs() as logs:
            actions = restore_devices(store, b, LOG)
        store._db = db
        assert [(a["device"], a["after_mw"]) for a in actions] == [(d.uuid, 700_000) for d in devs]
        assert [d.power_limit_mw() for d in devs] == [700_000, 700_000]
        warned = [r for r in logs if r["event"] == "device_originals_not_forgotten"]
        assert len(warned) == 1 and warned[0]["devices"] == [d.uuid for d in devs], logs
        assert "full" in warned[0]["error"] and warned[0]["log_level"] == "warning"
        assert sorted(store.originals()) == sorted(d.uuid for d in devs)
        # the next start: the stored originals are what the devices hold
        _, rec = reconcile(store, b, clock=lambda: 2.0)
        assert rec.devices_not_original == {}
        assert restore_devices(store, b, LOG) == [] and store.originals() == {}


def test_reconcile_drops_grants_of_gone_devices_and_processes(tmp_path: Path) -> None:
    b = PersistentSimBackend(["h100-80gb"], tmp_path / "sim.json")
    uuid = b.devices()[0].uuid
    with Store(tmp_path) as store:
        ledger, _ = reconcile(store, b, clock=lambda: 1.0)
        keep = ledger.grant("a", 100, device_id=uuid, pid=111)
        dead = ledger.grant("b", 100, device_id=uuid, pid=222)
        records = ledger.to_records()
        records["grants"].append({**records["grants"][0], "grant_id": "elsewhere", "device_id": "GPU-gone"})
        store.save_ledger(records)
        ledger, rec = reconcile(store, b, clock=lambda: 2.0, pid_exists=lambda pid: pid == 111)
    assert [g.grant_id for g in ledger.grants()] == [keep.grant_id]
    assert rec.released_gone_process == [dead.grant_id] and rec.released_gone_device == ["elsewhere"]


def test_a_model_that_does_not_load_stops_the_start(tmp_path: Path) -> None:
    import pytest

    from vgpu.daemon.serve import StartupError, load_model

    assert load_model("") is None
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"garbage")
    with pytest.raises(StartupError, match=r"manager.model .*bad.pt"):
        load_model(str(bad))
