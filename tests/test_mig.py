"""The MIG planner and reconfigurer on the simulated GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vgpu.allocator.mechanisms.mig import (
    MigNeed,
    MigReconfigurer,
    MigScheduler,
    choose_layout,
    format_plan,
    layout_of,
    needs_ahead,
    plan_steps,
)
from vgpu.device.errors import InUse
from vgpu.device.sim import ManualClock, SimBackend, without_mig
from vgpu.device.skus import LayoutSlot, get_sku, layout_problem, valid_layouts
from vgpu.traces import AppTrace

SKU = get_sku("h100-80gb")


def sim(**kw: object) -> tuple[SimBackend, ManualClock]:
    clock = ManualClock()
    return SimBackend(["h100-80gb"], clock=clock, mig_enabled=True, **kw), clock  # type: ignore[arg-type]


def mem_of(slot: LayoutSlot) -> int:
    prof = SKU.profile(slot.profile_id)
    assert prof is not None
    return prof.mem_mib


def test_chosen_layout_fits_every_need_and_is_valid() -> None:
    needs = [MigNeed("a", 15_000, 10), MigNeed("b", 30_000, 40), MigNeed("c", 5_000, 5)]
    choice = choose_layout(SKU, needs)
    assert choice is not None
    assert layout_problem(SKU, choice.layout) is None
    slots = dict(choice.assignment)
    assert len(set(slots.values())) == 3  # one instance each
    for n in needs:
        assert mem_of(slots[n.app_id]) >= n.mem_mib
        prof = SKU.profile(slots[n.app_id].profile_id)
        assert prof is not None and prof.slice_count / 7 * 100 >= n.sm_pct
    assert len(choice.layout) == 3  # no instance nobody needs


def test_no_layout_for_needs_beyond_the_gpu() -> None:
    assert choose_layout(SKU, [MigNeed("a", 90_000)]) is None
    assert choose_layout(SKU, [MigNeed(str(i), 1_000) for i in range(8)]) is None
    with pytest.raises(ValueError, match="once"):
        choose_layout(SKU, [MigNeed("a", 1), MigNeed("a", 2)])
    with pytest.raises(ValueError):
        MigNeed("a", -1)


def test_choice_prefers_keeping_the_current_instances() -> None:
    current = (LayoutSlot(0, 9),)  # a 3g.40gb at 0
    choice = choose_layout(SKU, [MigNeed("a", 30_000), MigNeed("b", 8_000)], current)
    assert choice is not None and LayoutSlot(0, 9) in choice.layout
    assert choice.changes == 1


def test_plan_changes_one_instance_per_step_destroys_first() -> None:
    backend, _ = sim()
    dev = backend.devices()[0]
    dev.create_gpu_instance(0, 0)  # 7g.80gb
    steps = plan_steps(SKU, dev.gpu_instances(), (LayoutSlot(0, 9), LayoutSlot(4, 9)))
    assert [s.kind for s in steps] == ["destroy", "create", "create"]
    assert "destroy GPU instance" in format_plan("gpu0", steps)
    with pytest.raises(ValueError, match="not valid"):
        plan_steps(SKU, [], (LayoutSlot(0, 0), LayoutSlot(0, 9)))


def test_apply_reaches_the_target_verifies_and_again_makes_zero_writes(tmp_path: Path) -> None:
    backend, _ = sim()
    dev = backend.devices()[0]
    rec = MigReconfigurer(dev, state_path=tmp_path / "mig.json")
    target = (LayoutSlot(0, 9), LayoutSlot(4, 14), LayoutSlot(6, 19))
    res = rec.apply(target)
    assert res.complete and res.writes == 3 and len(res.done) == 3
    assert layout_of(dev.gpu_instances()) == target
    writes = dev.writes
    again = rec.apply(target)
    assert again.writes == 0 and again.steps == () and dev.writes == writes


@pytest.mark.parametrize("layout", valid_layouts(SKU)[::97])
def test_round_trip_over_valid_layouts(layout: tuple[LayoutSlot, ...]) -> None:
    backend, _ = sim()
    dev = backend.devices()[0]
    rec = MigReconfigurer(dev)
    assert rec.apply(layout).complete
    assert layout_of(dev.gpu_instances()) == tuple(sorted(layout))
    assert rec.apply(layout).writes == 0
    rec.restore()
    assert dev.gpu_instances() == []


def test_dry_run_prints_the_plan_and_writes_nothing() -> None:
    backend, _ = sim()
    dev = backend.devices()[0]
    rec = MigReconfigurer(dev, dry_run=True)
    res = rec.apply((LayoutSlot(0, 0),))
    assert res.dry_run and len(res.steps) == 1 and res.writes == 0
    assert dev.writes == 0 and dev.gpu_instances() == []
    assert rec.original is None  # nothing changed, nothing to restore
    assert rec.restore() is None


def test_in_use_instance_is_never_destroyed_and_is_retried_later(tmp_path: Path) -> None:
    backend, clock = sim(mig_reconfig_s=0.0)
    dev = backend.devices()[0]
    rec = MigReconfigurer(dev, state_path=tmp_path / "mig.json")
    assert rec.apply((LayoutSlot(0, 9), LayoutSlot(4, 9))).complete
    busy = next(gi for gi in dev.gpu_instances() if gi.placement.start == 0)
    trace = AppTrace("app", np.arange(5.0), {"mem_used_mib": np.full(5, 1000.0), "sm_util_pct": np.full(5, 50.0)})
    backend.launch("app", 4242, trace, 0, gpu_instance_id=busy.instance_id)
    clock.advance(1.0)
    with pytest.raises(InUse):  # the simulator itself refuses, as a real GPU does
        dev.destroy_gpu_instance(busy.instance_id)
    res = rec.apply((LayoutSlot(0, 0),))  # wants one 7g: needs both gone
    assert not res.complete
    reasons = [why for _, why in res.skipped]
    assert any(r.startswith("IN_USE") for r in reasons)
    assert any(r.startswith("blocked") for r in reasons)
    assert any(gi.instance_id == busy.instance_id for gi in dev.gpu_instances())
    # the process ends; the retry completes
    clock.advance(10.0)
    assert rec.apply((LayoutSlot(0, 0),)).complete
    assert layout_of(dev.gpu_instances()) == (LayoutSlot(0, 0),)


def test_restore_puts_the_checkpointed_layout_back_even_after_a_restart(tmp_path: Path) -> None:
    backend, _ = sim()
    dev = backend.devices()[0]
    dev.create_gpu_instance(9, 0)
    dev.create_gpu_instance(9, 4)
    original = layout_of(dev.gpu_instances())
    state = tmp_path / "mig.json"
    MigReconfigurer(dev, state_path=state).apply((LayoutSlot(0, 0),))
    assert state.exists()
    # a new process (the daemon restarted) finds the checkpoint and restores from it
    rec = MigReconfigurer(dev, state_path=state)
    assert rec.original == original
    res = rec.restore()
    assert res is not None and res.complete
    assert layout_of(dev.gpu_instances()) == original
    assert not state.exists()


def test_corrupt_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    backend, _ = sim()
    state = tmp_path / "mig.json"
    state.write_text("{not json")
    with pytest.raises(ValueError, match="unreadable MIG checkpoint"):
        MigReconfigurer(backend.devices()[0], state_path=state)


def test_no_mig_and_no_permission_turn_the_mechanism_off() -> None:
    backend = SimBackend([without_mig(SKU)], clock=ManualClock())
    rec = MigReconfigurer(backend.devices()[0], sku=SKU)
    res = rec.apply((LayoutSlot(0, 0),))
    assert res.disabled is not None and "NotSupported" in res.disabled
    assert rec.apply(()).disabled == res.disabled  # stays off, no new attempt

    locked, _ = sim(privileged=False)
    rec = MigReconfigurer(locked.devices()[0])
    res = rec.apply((LayoutSlot(0, 0),))
    assert res.disabled is not None and "NoPermission" in res.disabled
    assert locked.devices()[0].gpu_instances() == []


def test_needs_ahead_extends_a_rising_forecast_and_never_lowers() -> None:
    h = (1, 2, 3, 4, 5)
    assert needs_ahead(h, (10, 20, 30, 40, 50), 8.0) == pytest.approx(80)
    assert needs_ahead(h, (50, 40, 30, 20, 10), 8.0) == pytest.approx(50)
    assert needs_ahead(h, (10, 20, 30, 40, 50), 3.0) == pytest.approx(50)
    assert np.isnan(needs_ahead(h, (np.nan,) * 5, 8.0))


def test_scheduler_acts_a_reconfiguration_time_ahead() -> None:
    sched = MigScheduler(SKU, reconfig_s=2.0)
    assert sched.lead_s == 6.0  # never less than 6 s
    current = (LayoutSlot(0, 15),)  # 1g.20gb
    # now: 15 GB; in 5 s the P90 rises 2 GB/s to 24 GB, at 6 s ahead it will be 26 GB
    ahead = needs_ahead((1, 2, 3, 4, 5), (16_000, 18_000, 20_000, 22_000, 24_000), sched.lead_s)
    assert ahead == pytest.approx(26_000)
    choice = sched.decide(current, [MigNeed("a", 15_000)], [MigNeed("a", ahead)])
    assert choice is not None
    assert mem_of(dict(choice.assignment)["a"]) >= 26_000
    # a need the current layout still covers changes nothing
    assert sched.decide(current, [MigNeed("a", 15_000)], [MigNeed("a", 18_000)]) is None


def test_layout_mechanism_serves_the_allocator_protocol(tmp_path: Path) -> None:
    from vgpu.allocator.mechanisms.mig import MigLayoutMechanism, layout_for_profiles
    from vgpu.allocator.policy.base import MigOutcome
    from vgpu.device.errors import InvalidArgument

    backend, _ = sim()
    dev = backend.devices()[0]
    mech = MigLayoutMechanism(state_dir=tmp_path)
    assert mech.apply(dev, ["3g.40gb", "3g.40gb"]) == MigOutcome(True, 0, "")
    assert sorted(gi.profile_name for gi in dev.gpu_instances()) == ["3g.40gb", "3g.40gb"]
    assert mech.apply(dev, ["3g.40gb", "3g.40gb"]) == MigOutcome(False, 0, "")  # already there: no change
    # keeps one 3g and replaces the other
    assert mech.apply(dev, ["3g.40gb", "2g.20gb", "1g.10gb"]).changed
    assert mech.last[dev.uuid].writes == 3
    with pytest.raises(InvalidArgument):
        layout_for_profiles(SKU, ["9g.99gb"])
    with pytest.raises(InvalidArgument):
        layout_for_profiles(SKU, ["7g.80gb", "1g.10gb"])
    mech.restore()
    assert dev.gpu_instances() == []


def test_layout_mechanism_outcome_counts_undone_steps_and_turning_off_once() -> None:
    from vgpu.allocator.mechanisms.mig import MigLayoutMechanism
    from vgpu.allocator.policy.base import MigOutcome
    from vgpu.device.errors import NoPermission

    backend, clock = sim(mig_reconfig_s=0.0)
    dev = backend.devices()[0]
    mech = MigLayoutMechanism()
    assert mech.apply(dev, ["3g.40gb", "3g.40gb"]).changed
    busy = next(gi for gi in dev.gpu_instances() if gi.placement.start == 0)
    trace = AppTrace("app", np.arange(5.0), {"mem_used_mib": np.full(5, 1000.0), "sm_util_pct": np.full(5, 50.0)})
    backend.launch("app", 4242, trace, 0, gpu_instance_id=busy.instance_id)
    clock.advance(1.0)
    # one 7g needs both 3g gone: the busy one stays (IN_USE), the create is blocked, the free one goes
    out = mech.apply(dev, ["7g.80gb"])
    assert out.changed and out.failed_steps == 2
    assert "IN_USE" in out.reason and "blocked" in out.reason
    clock.advance(10.0)  # the process has ended: the retry completes
    assert mech.apply(dev, ["7g.80gb"]) == MigOutcome(True, 0, "")
    # a refusal turns the mechanism off for the device: one failed step now, none afterwards
    dev.inject("destroy_gpu_instance", NoPermission, times=None)
    off = mech.apply(dev, ["3g.40gb", "3g.40gb"])
    assert not off.changed and off.failed_steps == 3 and off.reason.startswith("off: NoPermission")
    again = mech.apply(dev, ["3g.40gb", "3g.40gb"])
    assert again.failed_steps == 0 and not again.changed and again.reason.startswith("off:")
    # dry-run plans without writing and without failing
    dry = MigLayoutMechanism(dry_run=True)
    dev.clear_faults()
    assert dry.apply(dev, ["3g.40gb", "3g.40gb"]) == MigOutcome(False, 0, "")
    assert [gi.profile_name for gi in dev.gpu_instances()] == ["7g.80gb"]
