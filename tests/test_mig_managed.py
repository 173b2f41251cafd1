"""MIG in the daemon's policy: on a simulated A100 in MIG mode whose layout vgpu manages, the
forecast need of an application is given an instance before the need arrives, by at least the
reconfiguration time, and a busy instance is never touched."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from vgpu.allocator.core import Allocator
from vgpu.allocator.mechanisms.mig import MigLayoutMechanism
from vgpu.allocator.policy.base import Recommendation
from vgpu.allocator.policy.forecast import ForecastPolicy
from vgpu.device.sim import ManualClock, SimBackend
from vgpu.traces import AppTrace


def _flat(app: str, mem_mib: float, sm_pct: float, seconds: int = 120) -> AppTrace:
    t = np.arange(0.0, float(seconds))
    return AppTrace(app, t, {"mem_used_mib": np.full(seconds, mem_mib), "sm_util_pct": np.full(seconds, sm_pct)})


def _rig(tmp_path: Path, manage: bool) -> tuple[SimBackend, ManualClock, Allocator, int]:
    clock = ManualClock(1000.0)
    backend = SimBackend(["a100-40gb"], clock=clock, mig_enabled=True)
    dev = backend.devices()[0]
    one_g = next(p for p in dev.gpu_instance_profiles() if p.name == "1g.5gb")
    busy = dev.create_gpu_instance(one_g.profile_id, 0)
    clock.advance(10.0)  # the operator's instance is ready
    backend.launch("a", 11, _flat("a", 3_000.0, 10.0), gpu_instance_id=busy.instance_id)
    allocator = Allocator(backend, clock=clock, dry_run=False, policy=ForecastPolicy(manage_mig=manage),
                          mig=MigLayoutMechanism(state_dir=tmp_path))
    return backend, clock, allocator, busy.instance_id


def _recs(device_id: str, b_forecast_mib: float) -> list[Recommendation]:
    return [
        Recommendation("a", device_id, 3_000.0, 10.0, "model", mem_p90_peak_mib=3_000.0, sm_p90_peak_pct=10.0,
                       mem_used_mib=3_000.0, sm_util_pct=10.0),
        # b registered and forecast to need 15 GB and 30 % of the GPU; it has not started yet
        Recommendation("b", device_id, b_forecast_mib, 30.0, "model", mem_p90_peak_mib=b_forecast_mib,
                       sm_p90_peak_pct=30.0, mem_used_mib=math.nan, sm_util_pct=math.nan),
    ]


def test_a_layout_change_is_ready_before_the_need_it_serves(tmp_path: Path) -> None:
    backend, clock, allocator, busy_id = _rig(tmp_path, manage=True)
    dev = backend.devices()[0]
    decided_at = clock()
    need_at = decided_at + 8.0  # b starts using 15 GB 8 s from now (beyond the 6 s reconfiguration)
    report = allocator.apply_recommendations(_recs(dev.uuid, 15_000.0))
    assert report.mig_changes == 1 and allocator.counters.mig_changes == 1
    instances = {gi.instance_id: gi for gi in dev.gpu_instances()}
    assert busy_id in instances  # the busy instance was kept
    big = [gi for gi in instances.values() if gi.mem_total_mib >= 15_000]
    assert len(big) == 1
    ready_s = dev.gpu_instance_ready_s(big[0].instance_id)
    assert decided_at < ready_s <= need_at  # the change happened before the need, by the reconfiguration time
    # at the need, b starts at once in the instance made for it
    clock.set(need_at)
    launched = backend.launch("b", 12, _flat("b", 15_000.0, 30.0), gpu_instance_id=big[0].instance_id)
    assert launched.start_s == need_at
    # the layout fits now: the next plan changes nothing
    assert allocator.apply_recommendations(_recs(dev.uuid, 15_000.0)).mig_changes == 0
    allocator.stop()


def test_without_the_key_the_operator_layout_is_left_alone(tmp_path: Path) -> None:
    backend, _clock, allocator, _busy = _rig(tmp_path, manage=False)
    dev = backend.devices()[0]
    before = [gi.instance_id for gi in dev.gpu_instances()]
    assert allocator.apply_recommendations(_recs(dev.uuid, 15_000.0)).mig_changes == 0
    assert [gi.instance_id for gi in dev.gpu_instances()] == before


def test_a_busy_instance_is_never_destroyed_to_grow(tmp_path: Path) -> None:
    backend, _clock, allocator, busy_id = _rig(tmp_path, manage=True)
    dev = backend.devices()[0]
    # a, running in its 1g.5gb, is forecast to need 9 GB: its instance cannot be replaced under it
    recs = [Recommendation("a", dev.uuid, 9_000.0, 10.0, "model", mem_p90_peak_mib=9_000.0, sm_p90_peak_pct=10.0,
                           mem_used_mib=3_000.0, sm_util_pct=10.0)]
    allocator.apply_recommendations(recs)
    assert busy_id in {gi.instance_id for gi in dev.gpu_instances()}
    assert [p.gpu_instance_id for p in dev.processes()] == [busy_id]
